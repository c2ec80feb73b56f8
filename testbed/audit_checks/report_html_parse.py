"""report.html as the audit reads it: the standard library's ``html.parser`` (nothing rendered or
executed) collecting the Content-Security-Policy meta tags, each figure's images, caption and JSON
data blocks, and every problem of a self-contained page (a script that is not data, a reference
outside the file); `png_size` checks an inline PNG's chunk structure and CRCs."""

from __future__ import annotations

import base64
import binascii
import re
import struct
import zlib
from html.parser import HTMLParser

__all__ = ["parse_report", "png_size"]

_URL_ATTRS = {"src", "href", "srcset", "poster", "action", "formaction", "background", "data", "xlink:href", "cite",
              "longdesc", "usemap", "manifest", "ping"}
_CSS_URL = re.compile(r"url\(\s*(['\"]?)([^'\")]*)", re.IGNORECASE)
_PNG_SIG = b"\x89PNG\r\n\x1a\n"


class _Reader(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.figures: list[dict] = []
        self.problems: list[str] = []
        self.csp: list[str] = []
        self._fig = None
        self._in_caption = False
        self._script = None  # (type, id, text parts) of the open <script>
        self._in_style = False

    def _refs(self, tag, attrs):
        for name, value in attrs:
            value = (value or "").strip()
            if name in _URL_ATTRS and not (value.startswith("data:") or value.startswith("#")):
                self.problems.append(f"<{tag} {name}=\"{value[:80]}\"> references something outside the file")
            if name == "style":
                self._css(value, f"<{tag} style>")
            if name.startswith("on"):
                self.problems.append(f"<{tag}> has an event handler attribute {name} (executable)")

    def _css(self, text, where):
        for _, url in _CSS_URL.findall(text):
            if not (url.strip().startswith("data:") or url.strip().startswith("#")):
                self.problems.append(f"{where} url({url[:80]}) references something outside the file")
        if "@import" in text.lower():
            self.problems.append(f"{where} has an @import")

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self._refs(tag, attrs)
        equiv = (a.get("http-equiv") or "").lower()
        if tag == "meta" and equiv == "content-security-policy":
            self.csp.append(a.get("content") or "")
        elif tag == "meta" and equiv == "refresh":
            self.problems.append("a <meta http-equiv=\"refresh\"> (navigates away from the file)")
        elif tag == "figure":
            if self._fig is not None:
                self.problems.append("a <figure> inside another figure")
            self._fig = {"key": a.get("data-key"), "id": a.get("id"), "imgs": [], "caption": [], "data": []}
            self.figures.append(self._fig)
        elif tag == "img":
            if self._fig is None:
                self.problems.append("an <img> outside any figure")
            else:
                self._fig["imgs"].append(a.get("src") or "")
        elif tag == "figcaption":
            self._in_caption = True
        elif tag == "script":
            self._script = ((a.get("type") or "").strip().lower(), a.get("id"), [])
        elif tag == "style":
            self._in_style = True
        elif tag in ("iframe", "object", "embed", "link", "base", "frame"):
            self.problems.append(f"a <{tag}> element (the report needs none)")

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag == "script":
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag == "figure":
            self._fig = None
        elif tag == "figcaption":
            self._in_caption = False
        elif tag == "style":
            self._in_style = False
        elif tag == "script" and self._script is not None:
            kind, sid, text = self._script
            self._script = None
            if kind != "application/json":
                self.problems.append(f"an executable <script> (type {kind!r}); the report must need no script")
            elif self._fig is None:
                self.problems.append(f"a JSON data block ({sid}) outside any figure")
            else:
                self._fig["data"].append("".join(text))

    def handle_data(self, data):
        if self._script is not None:
            self._script[2].append(data)
        elif self._in_style:
            self._css(data, "<style>")
        elif self._in_caption and self._fig is not None:
            self._fig["caption"].append(data)


def parse_report(text: str) -> _Reader:
    r = _Reader()
    r.feed(text)
    r.close()
    return r


def png_size(src: str) -> tuple[int, int]:
    """Width and height of an inline PNG ``data:`` URI; ValueError unless every chunk's CRC holds and
    it ends with IEND."""
    prefix = "data:image/png;base64,"
    if not src.startswith(prefix):
        raise ValueError("image is not an inline PNG (data:image/png;base64,...)")
    try:
        raw = base64.b64decode(src[len(prefix):], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image payload is not valid base64") from None
    if not raw.startswith(_PNG_SIG):
        raise ValueError("image payload is not a PNG (bad signature)")
    pos, size, seen_end = len(_PNG_SIG), None, False
    while pos < len(raw):
        if pos + 12 > len(raw):
            raise ValueError("PNG truncated inside a chunk header")
        length, ctype = struct.unpack(">I4s", raw[pos:pos + 8])
        body = raw[pos + 8:pos + 8 + length]
        if len(body) != length or pos + 12 + length > len(raw):
            raise ValueError("PNG truncated inside a chunk")
        (crc,) = struct.unpack(">I", raw[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(ctype + body) != crc:
            raise ValueError(f"PNG chunk {ctype!r} fails its CRC")
        if size is None:
            if ctype != b"IHDR" or length != 13:
                raise ValueError("PNG does not start with an IHDR chunk")
            size = struct.unpack(">II", body[:8])
        seen_end = ctype == b"IEND"
        pos += 12 + length
        if seen_end:
            break
    if not seen_end or pos != len(raw):
        raise ValueError("PNG does not end with its IEND chunk")
    if size[0] == 0 or size[1] == 0:
        raise ValueError(f"PNG is {size[0]} x {size[1]} pixels")
    return size

