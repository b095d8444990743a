"""Tests, examples, benchmarks and the library dial only this machine: no literal IP address
outside the loopback range (127.0.0.0/8, ::1) appears in their code, except the few strings in
:data:`ALLOWED` that are documentation and never dialled. A test that needs a host that never
answers makes one on loopback (``tests/test_sweep_ray.py``'s ``hanging_port``)."""

from __future__ import annotations

import io
import ipaddress
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: where code that runs lives: the library's four packages, the tests, examples, benchmarks, scripts
SCANNED = ("common", "hooks", "probes", "analyses", "tests", "examples", "benchmarks", "scripts", ".ci")
SUFFIXES = {".py", ".sh", ".toml", ".yml", ".yaml", ".cfg", ".json", ".js", ".html", ".j2", ""}
#: (file relative to the root, address): literal addresses that are text, never dialled
ALLOWED: set[tuple[str, str]] = set()

IPV4 = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?![\w.])")
IPV6 = re.compile(r"(?<![\w:.])([0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7})(?![\w:])")


def addresses(text: str) -> list[str]:
    """Every literal IPv4 or IPv6 address in ``text`` that is not loopback (``ipaddress``
    decides what parses as an address: version numbers with an octet over 255 and clock times
    like 10:30 do not)."""
    found = []
    for rx in (IPV4, IPV6):
        for m in rx.finditer(text):
            raw = m.group(1)
            if rx is IPV6 and (("::" not in raw and raw.count(":") < 7) or not re.search(r"[0-9A-Fa-f]", raw)):
                continue  # a time or a ratio ("1:2:3"), or "::" alone: not a written-out IPv6 address
            try:
                ip = ipaddress.ip_address(raw)
            except ValueError:
                continue
            if not ip.is_loopback:
                found.append(raw)
    return found


def code_text(path: Path) -> str:
    """What of a file could name an address to dial: a Python file's string literals (so slices
    like ``x[1::2]`` are not read as IPv6), every other file whole."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".py":
        return text
    toks = tokenize.generate_tokens(io.StringIO(text).readline)
    return "\n".join(t.string for t in toks if t.type == tokenize.STRING)


def _files():
    for top in SCANNED:
        base = ROOT / top
        if not base.exists():
            continue
        for path in sorted(base.rglob("*")):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                yield path


def test_the_scanner_finds_what_it_must_and_passes_loopback():
    text = 'RayEngine(address="10.255.255.1:6379") ; bind("0.0.0.0") ; "fe80::1" ; ("2001:db8::7", 1)'
    assert addresses(text) == ["10.255.255.1", "0.0.0.0", "fe80::1", "2001:db8::7"]
    assert addresses('"127.0.0.1:6379", "127.8.9.10", "[::1]:80", "localhost"') == []
    assert addresses("version 1.2.3.400, torch==2.13.0, at 10:30:15, x[1:2:3]") == []


def test_python_files_are_read_for_their_strings(tmp_path):
    src = tmp_path / "m.py"
    src.write_text('x = y[1::2]  # 10.0.0.1 in a comment is no call\nconnect(("192.168.1.5", 80))\n')
    assert addresses(code_text(src)) == ["192.168.1.5"]


def test_no_code_dials_an_address_beyond_loopback():
    bad = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "tests/test_loopback_only.py":
            continue  # the scanner's own examples above
        whole = path.read_text(encoding="utf-8", errors="replace")
        for addr in addresses(code_text(path)):
            if (rel, addr) not in ALLOWED:
                line = whole[: whole.find(addr)].count("\n") + 1
                bad.append(f"{rel}:{line}: {addr}")
    if bad:
        pytest.fail(
            "literal addresses beyond loopback (tests, examples and benchmarks may dial only 127.0.0.0/8 or ::1; "
            "add documentation strings that are never dialled to ALLOWED):\n" + "\n".join(bad)
        )
