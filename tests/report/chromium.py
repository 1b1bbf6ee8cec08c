"""Headless Chromium (Debian's `chromium` package, installed by scripts/setup.sh) for HTML tests.

This machine's network is closed: without the background-networking flags Chromium's start-up
requests are refused, so every run uses all of them and a fresh profile directory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Appended to a copy of the page: measures each figure's SVG once the page is laid out and
# writes the result into the DOM, which --dump-dom prints.
PROBE = """
<script>
const figures = [...document.querySelectorAll('figure.plot')].map(figure => {
  const svg = figure.querySelector('svg');
  const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  const marks = svg ? [...svg.querySelectorAll('path, use, image, rect')] : [];
  const drawn = marks.filter(e => { const b = e.getBBox(); return b.width > 0 || b.height > 0; }).length;
  return {id: figure.id, width: box.width, height: box.height, marks: marks.length, drawn: drawn};
});
const probe = document.createElement('pre');
probe.id = 'probe';
probe.textContent = JSON.stringify(figures);
document.body.appendChild(probe);
</script>
"""


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("headless Chromium is missing: run scripts/setup.sh (it apt-get installs `chromium`)")
    return found


def run_chromium(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="tdiff-chromium-") as profile:
        return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout)


def measure_figures(html_path, tmp_path) -> list[dict]:
    """Open the page in Chromium and measure its figures (id, size, drawn marks)."""
    page = html_path.read_text(encoding="utf-8")
    probed = tmp_path / "probed.html"
    probed.write_text(page.replace("</body>", PROBE + "</body>"), encoding="utf-8")
    result = run_chromium("--virtual-time-budget=10000", "--dump-dom", probed.as_uri())
    assert result.returncode == 0, result.stderr[-2000:]
    start = result.stdout.index('<pre id="probe">') + len('<pre id="probe">')
    return json.loads(result.stdout[start:result.stdout.index("</pre>", start)].replace("&quot;", '"'))


def screenshot(html_path, png_path, *, width: int = 1300, height: int = 2600):
    result = run_chromium("--hide-scrollbars", f"--window-size={width},{height}", f"--screenshot={png_path}",
                          html_path.as_uri())
    assert result.returncode == 0 and png_path.is_file(), result.stderr[-2000:]
    return png_path
