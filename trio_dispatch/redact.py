"""Keeping secrets and hostile text out of what we print (docs/security.md).

- :func:`mask_url` hides the password of a URL (``postgresql://user:***@host/db``);
  :func:`scrub` does it for every URL inside a text and removes known secret
  values wherever they appear (a driver's error may quote a connection
  string). Every log line, error, CLI output and ``--json`` document that
  shows a store goes through them.
- :func:`visible` makes control and escape characters of outside text (a
  kind, a route, a destination's stderr, a payload) visible as escapes, so
  they can neither forge a log line nor reach the operator's terminal.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from collections.abc import Iterable
from typing import Final
from urllib.parse import unquote

MASK: Final = "***"

_URL_START: Final = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://")
# ...?password=...  /  password=... (libpq key/value and URL query forms)
_PASSWORD_PARAM: Final = re.compile(
    r"(?P<head>\b(?:\w*password|passwd|pwd|\w*secret|\w*token)\s*=\s*)"
    r"(?P<value>'[^']*'|[^\s&;']+)",
    re.IGNORECASE,
)
MIN_SCRUBBED_LENGTH: Final = 3
"""Known secrets shorter than this are not searched for in free text (they
would mangle every message); URL and ``password=`` forms are masked anyway."""
MIN_PIECE_LENGTH: Final = 8
"""A piece of a secret (a password split where a driver might split it) is
searched for only from this length: shorter pieces are ordinary words
("correct horse battery staple") that would be masked everywhere."""


def _password_span(text: str, start: int, whole: bool, limit: int) -> tuple[int, int] | None:
    """Where the password of the URL whose authority starts at ``start``
    lies in ``text``, or None. A password may hold ``@`` or ``/`` unescaped
    (people write them so): the userinfo ends at the last ``@`` of the
    authority, else -- when the authority reads ``user:something`` that is
    not a port -- at the next ``@``. In free text a URL ends at whitespace;
    a ``whole`` text is one URL, whose password may hold spaces. When in
    doubt, more is masked."""
    stop = limit  # where the next URL starts, else the end
    for index in range(start, limit if not whole else start):
        if text[index].isspace():
            stop = index
            break
    end = stop
    for sep in "/?#":
        found = text.find(sep, start, stop)
        if found >= 0:
            end = min(end, found)
    authority = text[start:end]
    colon = authority.find(":")
    if whole and colon >= 0 and not authority[colon + 1 :].isdigit():
        # One URL whose authority reads "user:secret...": the userinfo ends
        # at the last "@", even past a "/", "?" or "#" the password holds.
        last = text.rfind("@", start, stop)
        if last >= end:
            end = last + 1
            authority = text[start:end]
    if "@" in authority:
        at = start + authority.rfind("@")
    else:
        colon = authority.find(":")
        after = authority[colon + 1 :] if colon >= 0 else ""
        if colon < 0 or not after or after.isdigit():
            return None
        at = text.find("@", end, stop)
        if at < 0:
            return None
    colon = text.find(":", start, at)
    if colon < 0:
        return None
    return colon + 1, at


def _password_spans(text: str) -> list[tuple[int, int]]:
    # A text that begins with a URL is that URL (a store or endpoint setting),
    # spaces in its password included.
    whole = _URL_START.match(text) is not None
    matches = list(_URL_START.finditer(text))
    spans: list[tuple[int, int]] = []
    for index, match in enumerate(matches):
        limit = matches[index + 1].start() if index + 1 < len(matches) else len(text)
        span = _password_span(text, match.end(), whole and match.start() == 0, limit)
        if span is not None and (not spans or span[0] >= spans[-1][1]):
            spans.append(span)
    return spans


def ambiguous_userinfo(url: str) -> bool:
    """Whether a URL's host cannot be told from its user name and password:
    after ``scheme://`` it holds more than one ``@``, or a ``/``, ``?`` or
    ``#`` before its ``@``. Parsers disagree on such a URL (one reads a
    piece of the password as the host and quotes it in an error), so it is
    refused, never parsed. Never raises."""
    start = _URL_START.match(url)
    if start is None:
        return False
    rest = url[start.end() :]
    if rest.count("@") > 1:
        return True
    at = rest.find("@")
    return at >= 0 and any(sep in rest[:at] for sep in "/?#")


AMBIGUOUS_URL_ERROR: Final = (
    "its user name or password holds an unencoded '@', '/', '?' or '#', so the host "
    "cannot be told apart: percent-encode them (%40, %2F, %3F, %23)"
)
"""Why an ambiguous URL is refused; it never quotes the URL."""


def mask_url(url: str) -> str:
    """``url`` -- or every URL in a text -- with its password (and any
    ``password=`` parameter) replaced by ``***``; text without one is
    returned unchanged. Never raises."""
    pieces: list[str] = []
    last = 0
    for begin, end in _password_spans(url):
        pieces += [url[last:begin], MASK]
        last = end
    masked = "".join(pieces) + url[last:]
    return _PASSWORD_PARAM.sub(lambda m: f"{m['head']}{MASK}", masked)


def url_secrets(url: str) -> list[str]:
    """The secret values a URL holds (its password, as written and decoded,
    and ``password=`` parameters): what :func:`scrub` must also find when a
    driver quotes the URL in pieces."""
    found = [url[begin:end] for begin, end in _password_spans(url)]
    # A driver that splits a password at its own idea of the URL's pieces
    # quotes a piece: the pieces are secrets too, when long enough not to be
    # an ordinary word.
    found += [
        piece
        for value in found
        for piece in re.split(r"[@\s]", value)
        if len(piece) >= MIN_PIECE_LENGTH and piece != value
    ]
    found += [match["value"].strip("'") for match in _PASSWORD_PARAM.finditer(url)]
    decoded = [unquote(value) for value in found]
    return [value for value in dict.fromkeys(found + decoded) if value]


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URL password masked and every known secret value
    (at least :data:`MIN_SCRUBBED_LENGTH` characters long) replaced by
    ``***``. Never raises."""
    for secret in sorted(
        {s for s in secrets if len(s) >= MIN_SCRUBBED_LENGTH}, key=len, reverse=True
    ):
        text = text.replace(secret, MASK)
    return mask_url(text)


_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Control (Cc), format (Cf: bidi overrides, zero-width), line and paragraph
# separators, surrogates (undecodable input) and unassigned code points.
_HIDDEN_CATEGORIES: Final = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})


def _escape(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def visible(text: object) -> str:
    """``str(text)`` with every control, format, separator and surrogate
    character written as an escape (``\\n``, ``\\x1b``, ``\\u202e``):
    one line, nothing a terminal interprets. Printable text, non-ASCII
    letters included, is unchanged."""
    value = text if isinstance(text, str) else str(text)
    if value.isprintable():  # the common case: nothing to escape
        return value
    return "".join(
        _escape(char) if char != " " and unicodedata.category(char) in _HIDDEN_CATEGORIES else char
        for char in value
    )


def one_line(text: object, secrets: Iterable[str] = ()) -> str:
    """An error message fit for one line on stderr: secrets scrubbed,
    whitespace runs folded, escapes made visible."""
    return visible(" ".join(scrub(str(text), secrets).split()))


_known: set[str] = set()
_known_lock = threading.Lock()


def register_secrets(values: Iterable[str]) -> None:
    """Remember secret values of this process (a store URL's password, a
    webhook secret) so that :class:`SecretFilter` scrubs them from every log
    record of ours, whatever text carries them."""
    with _known_lock:
        _known.update(value for value in values if value)


def known_secrets() -> list[str]:
    with _known_lock:
        return list(_known)


class SecretFilter(logging.Filter):
    """Scrubs URL passwords and registered secrets from a record's message
    and traceback text before any handler sees it (defence in depth: the
    messages we write are masked already, but a driver's exception text may
    quote a connection string)."""

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = known_secrets()
        try:
            message = record.getMessage()
        except Exception:  # a broken %-format: leave it to the handler
            return True
        cleaned = scrub(message, secrets)
        if cleaned != message or record.args:
            record.msg, record.args = cleaned, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text, secrets)
        return True


def scrubbed_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with a :class:`SecretFilter` attached
    (once): every logger of the package is made this way."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, SecretFilter) for f in logger.filters):
        logger.addFilter(SecretFilter())
    return logger


_SECRET_NAME: Final = re.compile(
    r"SECRET|PASSW(OR)?D|PASSPHRASE|TOKEN|CREDENTIAL|PRIVATE|API_?KEY|ACCESS_?KEY|AUTH(?!OR)"
    r"|COOKIE|SESSION_?KEY|SIGNING|BEARER|WEBHOOK_?URL|(^|_)DSN$|(_|^)(KEY|PASS|PWD|PW|PAT|SK)$"
    r"|^DATABASE_URL$",
)
_NOT_SECRET: Final = frozenset({"PWD", "OLDPWD"})  # the shell's directories
_URL_CREDENTIALS: Final = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://[^\s/?#@:]*:(?![0-9]*(?:[/?#\s]|$))[^\s]*@"
)
"""``scheme://user:password@...`` anywhere in a value (a password may hold
``/`` or ``@`` unescaped, so the userinfo runs to the last ``@``; a port
followed by a path is not a password)."""


def looks_secret(name: str, value: str) -> bool:
    """Whether an environment variable looks like it holds a secret: its
    name says so (``*SECRET*``, ``*PASSWORD*``, ``*TOKEN*``, ``*BEARER*``,
    ``*WEBHOOK_URL*``, ``*_KEY``, ``*_PAT``, ``*_SK``, ``*AUTH*``,
    ``DATABASE_URL``, ...) or its value holds a URL with credentials
    (``scheme://user:password@host``) or a ``password=`` parameter."""
    if name in _NOT_SECRET:
        return False
    return bool(
        _SECRET_NAME.search(name.upper()) or _URL_CREDENTIALS.search(value) or url_secrets(value)
    )
