"""The source patcher: change a function of an installed package, in this process and in every
Python process a command starts, and undo it again.

    from tdiff.source_patcher import apply_patches, load_patch_file
    with apply_patches(load_patch_file("fixes.yaml").patches):
        ...

The YAML format is documented in docs/PATCHES.md; `tdiff patch apply/check/try` are its commands.
"""

from tdiff.source_patcher.apply import ActivePatches, apply_patches
from tdiff.source_patcher.errors import PatchError
from tdiff.source_patcher.spec import Candidate, Edit, PatchFile, PatchSpec, load_patch_file, parse_patch_file

__all__ = ["ActivePatches", "apply_patches", "PatchError", "Candidate", "Edit", "PatchFile", "PatchSpec",
           "load_patch_file", "parse_patch_file"]
