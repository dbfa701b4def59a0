"""A real browser opens the report from disk: no network request, no console error, and the
screenshot shows the verdict banner. Needs Debian's chromium (tests/run installs it)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.runstore import write_json
from pipeline.stages.signoff import signoff
from reports.render import render_run
from tests.minirun import load_results, make_run, recipe

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (tests/run installs it)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--mute-audio",
         # the browser's own background fetches (time sync, updates) must not leave the machine
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
         "--disable-features=NetworkTimeServiceQuerying,OptimizationHints,MediaRouter"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("browser") / "run"
    r = recipe([{"metric": "accuracy_delta", "op": ">=", "threshold": -0.05}])
    make_run(root, r, {"piqa": [1] * 60 + [0] * 40}, {"piqa": [1] * 60 + [0] * 40},
             question="<script>document.title='pwned'</script>")
    write_json(root / "signoff.json", signoff(r, "h", root, load_results(root)))
    return render_run(root)


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


def page_requests(netlog: Path) -> list[str]:
    """URLs the *page* asked for. Chromium's own background fetches carry no initiator (or
    'not an origin'); anything a file:// page loads carries the opaque origin 'null'."""
    text = netlog.read_text()
    try:
        events = json.loads(text)["events"]
    except ValueError:  # chromium may leave the log unterminated on exit
        events = json.loads(text.rstrip().rstrip(",") + "]}")["events"]
    return sorted({e["params"]["url"] for e in events if "url" in e.get("params", {})
                   and e["params"].get("initiator") not in (None, "not an origin")})


def test_the_network_check_can_fail(tmp_path):
    page = tmp_path / "control.html"
    page.write_text('<html><body><img src="http://127.0.0.1:9/x.png">control</body></html>')
    chromium(tmp_path, f"--log-net-log={tmp_path / 'net.json'}", "--dump-dom", page.as_uri())
    assert page_requests(tmp_path / "net.json") == ["http://127.0.0.1:9/x.png"]


def test_opens_offline_without_network_or_console_errors(report, tmp_path):
    netlog = tmp_path / "net.json"
    proc = chromium(tmp_path, "--enable-logging=stderr", "--v=0", f"--log-net-log={netlog}",
                    "--dump-dom", report.as_uri())
    assert "VERDICT: PASS" in proc.stdout
    # a dataset string that is a script did not run: the live DOM keeps the report's title
    assert "<title>quantize-eval: awq</title>" in proc.stdout and "pwned</title>" not in proc.stdout
    console = [ln for ln in proc.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
    assert page_requests(netlog) == []


def test_screenshot_shows_the_verdict(report, tmp_path):
    png = tmp_path / "shot.png"
    chromium(tmp_path, f"--screenshot={png}", "--window-size=1200,800", report.as_uri())
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    # the verdict banner's green (#dafbe1) is on the page: decode enough of the PNG to check
    import zlib

    import numpy as np

    pos, chunks, w = 8, [], 0
    while pos < len(data):
        n = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        if kind == b"IHDR":
            w, h = int.from_bytes(data[pos + 8:pos + 12], "big"), int.from_bytes(data[pos + 12:pos + 16], "big")
            bit_depth, color = data[pos + 16], data[pos + 17]
        if kind == b"IDAT":
            chunks.append(data[pos + 8:pos + 8 + n])
        pos += 12 + n
    assert bit_depth == 8 and color in (2, 6)
    ch = 3 if color == 2 else 4
    raw = zlib.decompress(b"".join(chunks))
    stride = w * ch + 1
    rows = []
    prev = np.zeros(w * ch, dtype=np.int32)
    for y in range(h):  # undo PNG filters
        f, line = raw[y * stride], np.frombuffer(raw[y * stride + 1:(y + 1) * stride], np.uint8).astype(np.int32)
        out = np.zeros_like(line)
        for x in range(len(line)):
            a = out[x - ch] if x >= ch else 0
            b = prev[x]
            c = prev[x - ch] if x >= ch else 0
            if f == 0:
                out[x] = line[x]
            elif f == 1:
                out[x] = (line[x] + a) & 255
            elif f == 2:
                out[x] = (line[x] + b) & 255
            elif f == 3:
                out[x] = (line[x] + (a + b) // 2) & 255
            else:
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                out[x] = (line[x] + pred) & 255
        rows.append(out)
        prev = out
        if y > 300:  # the banner sits near the top
            break
    img = np.array(rows).reshape(len(rows), w, ch)[:, :, :3]
    green = np.all(img == np.array([0xDA, 0xFB, 0xE1]), axis=2).sum()
    assert green > 2000, "verdict banner not visible in the screenshot"
