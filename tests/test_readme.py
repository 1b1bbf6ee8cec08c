import subprocess
import sys

from tests.helpers import REPO


def test_readme_cli_reference_matches_help():
    result = subprocess.run([sys.executable, "scripts/cli_reference.py", "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
