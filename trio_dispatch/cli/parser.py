"""The command line's grammar: argparse construction, each command's
options and help, the value types (durations, statuses, limits), and usage
errors as one line (exit 2). Each command names the function that runs it.
"""

from __future__ import annotations

import argparse
import re
import time
from typing import Any, Final, NoReturn

from .._version import __version__
from ..config import CONFIG_ENV_VAR, DEFAULT_CONFIG_NAME
from ..lifecycle import STATUSES
from ..outbox import DEFAULT_LIST_LIMIT, PRUNE_CHUNK
from ..outbox.cancel import DEFAULT_CANCEL_WAIT_SECONDS
from ..outbox.coalesce import require_coalesce
from ..outbox.ordering import require_ordering_key
from ..outbox.reads import MIN_ID_PREFIX
from ..redact import mask_url, visible
from ..store.base import DEFAULT_BUSY_TIMEOUT_SECONDS, check_busy_timeout
from ..times import TIME_HELP, read_time
from ..validate import INT_MAX, require_route
from .checkconfig import cmd_check_config
from .destinations import TIME_HELP as UNTIL_HELP
from .destinations import destination_arg, for_arg, until_arg
from .output import EXIT_USAGE
from .run import cmd_web, cmd_worker
from .stores import cmd_store

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """``90``, ``45s``, ``30m``, ``12h``, ``7d``, ``2w`` -> seconds."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a number with s, m, h, d or w (e.g. 7d)"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]


def _status_arg(text: str) -> str:
    if text not in STATUSES:
        allowed = ", ".join(sorted(STATUSES))
        raise argparse.ArgumentTypeError(
            f"invalid status {visible(repr(text))} (choose from {allowed})"
        )
    return text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse quotes the offending arguments: one line, escapes visible,
        # a URL's password masked.
        self.exit(EXIT_USAGE, f"{self.prog}: {visible(mask_url(message))}\n")


ID_HELP: Final = (
    f"the dispatch id, or a prefix of at least {MIN_ID_PREFIX} characters that only it starts with"
)


WAITING_HELP: Final = (
    "A keyed row waiting for its ordering key (behind a live row of its key, or, under "
    "dispatch.ordering.on_dead_letter block, behind a dead or expired head) has no next "
    'attempt time: its NEXT shows "waiting"; in --json "waiting" is true (false for every '
    "other row) and its next_attempt_at is not a time to read (the stored mark, 1e15, or "
    "when it was due before its key's head blocked)."
)


def _global_options(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """The options every command takes, before or after its name. After
    it, an option left out keeps what was given before (SUPPRESS: no
    default of the subcommand's overwrites it)."""
    group = (
        parser.add_argument_group("global options (also accepted before the command)")
        if after_command
        else parser
    )
    default: dict[str, Any] = {"default": argparse.SUPPRESS} if after_command else {}
    group.add_argument(
        "--db",
        metavar="PATH",
        help="the store (SQLite file, sqlite:/// or postgresql:// URL; a URL's schema: "
        "?options=-csearch_path%%3DNAME); default: the configuration's store and "
        "schema. Other local users can read argv: give a URL with a "
        "password with --db-env",
        **default,
    )
    group.add_argument(
        "--db-env",
        metavar="NAME",
        help="read the store (as --db) from the environment variable NAME, out of "
        "other users' sight (default: --db, else the configuration's store)",
        **default,
    )
    group.add_argument(
        "--config",
        metavar="FILE",
        help=f"configuration file (default ${CONFIG_ENV_VAR}, then ./{DEFAULT_CONFIG_NAME})",
        **default,
    )
    group.add_argument(
        "--busy-timeout",
        type=_busy_timeout,
        metavar="SECONDS",
        help="how long to wait for another process's lock (default: the "
        f"configuration's busy_timeout_seconds, else "
        f"{DEFAULT_BUSY_TIMEOUT_SECONDS:g})",
        **default,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trio-dispatch",
        description="Durable dispatch outbox: the worker, and operator tools that work "
        "directly on the store.",
        epilog="Exit codes: 0 applied/found, 1 not applied or not found, 2 bad usage "
        "or configuration.",
    )
    _global_options(parser, after_command=False)
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
    commands = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Parser
    )

    def command(name: str, help: str, *, data: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        if data:
            sub.add_argument("--json", action="store_true", help="print one JSON document")
        _global_options(sub, after_command=True)
        sub.set_defaults(handler=cmd_store)
        return sub

    def wide(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--wide",
            action="store_true",
            help="never cut a column to the terminal's width (output that is not a "
            "terminal is never cut)",
        )

    ls = command("ls", "list dispatches, newest first")
    ls.epilog = WAITING_HELP
    show = command("show", "one dispatch, whole, payload pretty-printed")
    show.epilog = WAITING_HELP
    ls.add_argument("--status", type=_status_arg, help="only this status (default: every status)")
    ls.add_argument("--kind", help="only this kind (default: every kind)")
    ls.add_argument(
        "--ordering-key",
        type=_ordering_key_arg,
        metavar="KEY",
        help="only rows of this ordering key (default: every row, keyed or not)",
    )
    ls.add_argument(
        "--coalesce-key",
        type=_coalesce_key_arg,
        metavar="KEY",
        help="only rows of this coalesce key: the one waiting unclaimed, the ones it "
        "superseded, the ones sent (default: every row)",
    )
    ls.add_argument(
        "--blocked",
        action="store_true",
        help="the heads of blocked ordering keys instead (dead_letter or expired rows "
        "first in a key with rows waiting behind them), oldest first; none when the "
        "configuration's dispatch.ordering.on_dead_letter is skip",
    )
    ls.add_argument(
        "--limit",
        type=_positive_int,
        default=DEFAULT_LIST_LIMIT,
        help=f"at most this many (default {DEFAULT_LIST_LIMIT})",
    )
    wide(ls)
    show.add_argument("id", help=ID_HELP)
    show.add_argument("--show-token", action="store_true", help="print the ack token")
    history = command("history", "a dispatch's status transitions, oldest first")
    history.add_argument("id", help=ID_HELP + " (purged dispatches included)")
    wide(history)
    ack = command("ack", "acknowledge a dispatch with its token")
    ack.add_argument("id", help=ID_HELP)
    ack.add_argument(
        "token",
        nargs="?",
        help="the dispatch's ack token, required unless --token-stdin (other local users "
        "can read argv: prefer --token-stdin)",
    )
    ack.add_argument(
        "--token-stdin",
        action="store_true",
        help="read the token from the first line of standard input instead",
    )
    _retry(command("retry", RETRY_HELP))
    _cancel(command("cancel", CANCEL_HELP))
    command("purge", "delete one dispatch (recorded in its history)").add_argument(
        "id", help=ID_HELP
    )
    prune = command("prune", "delete finished dispatches by age (recorded)")
    prune.add_argument(
        "--older-than",
        type=parse_duration,
        metavar="DURATION",
        help=(
            "e.g. 7d, 12h (default: delivered/acked/superseded 7d, "
            "dead_letter/expired/cancelled 30d)"
        ),
    )
    prune.add_argument(
        "--status",
        type=_status_list,
        action="append",
        metavar="STATUS[,...]",
        help="only these finished statuses (repeatable; default: all four)",
    )
    prune.add_argument("--dry-run", action="store_true", help="count, delete nothing")
    command("stats", "counts per status, oldest due pending, recent dead letters")
    command("migrate", "create the outbox schema, or bring it forward to this version")
    _schedules(command("schedules", SCHEDULES_HELP))
    _destinations(command("destinations", DESTINATIONS_HELP))
    check = command("check-config", "validate a configuration file, reporting every problem")
    check.add_argument(
        "file",
        nargs="?",
        metavar="FILE",
        help=f"the file to check (default: --config, then ${CONFIG_ENV_VAR}, "
        f"then ./{DEFAULT_CONFIG_NAME})",
    )
    check.set_defaults(handler=cmd_check_config)
    worker = command("worker", "run the delivery worker until SIGINT/SIGTERM", data=False)
    worker.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="also serve /metrics, /healthz and the dashboard there (default: the "
        "configuration's http.listen); beyond loopback it needs http.token",
    )
    worker.set_defaults(handler=cmd_worker)
    web = command(
        "web",
        "serve the dashboard (viewers read; with http.operator_token, operators act), "
        "/metrics and /healthz",
        data=False,
    )
    web.description = WEB_HELP
    web.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="where to listen (default: the configuration's http.listen, else "
        "127.0.0.1:9464); beyond loopback it needs http.token",
    )
    web.set_defaults(handler=cmd_web)
    return parser


WEB_HELP: Final = (
    "Serve the dashboard, /metrics and /healthz until SIGINT or SIGTERM. Viewers "
    "(http.token; anyone on loopback without one) read: counts, rows, history, "
    "schedules, destinations. With http.operator_token an operator may also act "
    "(retry and purge rows, one or by filter; pause, resume and enable "
    "destinations), and the store is opened for writing; without one the store "
    "is opened read-only and nobody can change anything."
)
RETRY_HELP: Final = (
    "operator retry of a dead_letter or expired dispatch; or, with filters instead of "
    "an id, of every one they match (replay)"
)
RETRY_EPILOG: Final = (
    f"TIME is {TIME_HELP}. --since and --until compare when each row last changed "
    "(updated_at: for a failed row, when it failed): since <= updated_at < until. "
    f"Rows go back to pending in id order (ordering keys keep their order), "
    f"{PRUNE_CHUNK} a transaction; interrupted, run it again: the rows already retried "
    "are pending and match no more, so none is retried twice. An expired row keeps its "
    "expires_at unless --expires-in is given (one whose deadline has passed expires again "
    "at the next scan). Exit codes: 0 it ran (whatever it matched), 1 a status retry "
    "does not apply to (--status pending), 2 bad usage."
)


def _retry(retry: argparse.ArgumentParser) -> None:
    """``retry ID``, or ``retry`` with filters: the replay."""
    retry.epilog = RETRY_EPILOG
    retry.add_argument(
        "id", nargs="?", help=ID_HELP + " (required unless filters are given instead)"
    )
    replay = retry.add_argument_group(
        "replay: every dead_letter and expired dispatch matching these filters (at least one)"
    )
    _row_filters(replay, "only dead_letter or only expired rows (default: both)")
    replay.add_argument(
        "--expires-in",
        type=parse_duration,
        metavar="DURATION",
        help="give each retried row a new deadline this long from now (e.g. 1d; default: "
        "each keeps its own)",
    )
    replay.add_argument(
        "--reason",
        metavar="TEXT",
        help="why, recorded in each row's transition (default: no reason)",
    )


def _row_filters(group: argparse._ArgumentGroup, status_help: str) -> None:
    """The filters that choose rows instead of an id (``retry``,
    ``cancel``), and ``--dry-run``."""
    group.add_argument(
        "--deliver-to",
        type=_route_arg,
        metavar="NAME",
        help="only rows for this destination (default: every destination)",
    )
    group.add_argument("--status", type=_status_arg, metavar="STATUS", help=status_help)
    group.add_argument(
        "--since",
        type=_time_arg,
        metavar="TIME",
        help="only rows that changed at or after TIME (default: no lower bound)",
    )
    group.add_argument(
        "--until",
        type=_time_arg,
        metavar="TIME",
        help="only rows that changed before TIME (default: no upper bound)",
    )
    group.add_argument("--kind", help="only rows of this kind (default: every kind)")
    group.add_argument(
        "--ordering-key",
        type=_ordering_key_arg,
        metavar="KEY",
        help="only rows of this ordering key (default: every row, keyed or not)",
    )
    group.add_argument("--dry-run", action="store_true", help="count, change nothing")


CANCEL_HELP: Final = (
    "cancel a pending dispatch, or cut and cancel its running attempt; or, with "
    "filters instead of an id, every pending and delivering one they match"
)
CANCEL_EPILOG: Final = (
    "A pending row is cancelled at once. A running attempt is marked: the worker "
    "running it cuts it within a second (a command's process group killed, a "
    "callable cancelled, an HTTP request dropped) and records cancelled, unless the "
    "attempt had already succeeded (too late: exit 1). With an id, the command waits "
    "--wait seconds for that worker; if it has not answered by then, the cancel stays "
    "asked for (exit 0): the worker records it, or the next claim once the attempt's "
    "lease ends. With filters nothing waits. A cancelled head of an ordering key lets "
    f"the key's next row go. TIME is {TIME_HELP}; --since and --until compare when "
    "each row last changed. Exit codes: 0 cancelled or asked for, 1 not applied (too "
    "late, another status, not found), 2 bad usage."
)


def _cancel(cancel: argparse.ArgumentParser) -> None:
    """``cancel ID``, or ``cancel`` with filters."""
    cancel.epilog = CANCEL_EPILOG
    cancel.add_argument(
        "id", nargs="?", help=ID_HELP + " (required unless filters are given instead)"
    )
    cancel.add_argument(
        "--wait",
        type=_seconds_arg,
        metavar="SECONDS",
        help="with an id: how long to wait for the worker of a running attempt to record "
        f"the cancel (default {DEFAULT_CANCEL_WAIT_SECONDS:g}; 0: do not wait)",
    )
    cancel.add_argument(
        "--reason",
        metavar="TEXT",
        help="why, recorded in each row's transition (default: no reason)",
    )
    many = cancel.add_argument_group(
        "bulk: every pending and delivering dispatch matching these filters (at least one)"
    )
    _row_filters(many, "only pending or only delivering rows (default: both)")


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(
            f"invalid seconds {visible(repr(text))}: give a number from 0 to 3600"
        )
    return value


SCHEDULES_HELP: Final = (
    "the configuration's schedules: cadence, timezone, paused, last and next fire "
    "(read-only); or pause, resume or run one"
)


def _schedules(schedules: argparse.ArgumentParser) -> None:
    """``schedules`` lists; ``schedules pause|resume|run NAME`` acts on one.
    The listing's options are taken after an action too (SUPPRESS: an
    option left out keeps what was given before the action)."""
    schedules.add_argument(
        "--wide",
        action="store_true",
        help="never cut a column to the terminal's width (output that is not a "
        "terminal is never cut)",
    )
    schedules.set_defaults(action=None)
    actions = schedules.add_subparsers(
        dest="action", metavar="ACTION", required=False, parser_class=_Parser
    )
    for name, help in (
        ("pause", "pause a schedule: no worker fires its ticks until it is resumed"),
        ("resume", "resume a paused schedule; its missed ticks follow its missed: policy"),
        ("run", "fire one extra run now (flagged manual, not a tick); print its dispatch id"),
    ):
        action = actions.add_parser(name, help=help, description=help)
        action.add_argument("name", metavar="NAME", help="the schedule's name in the configuration")
        action.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document"
        )
        _global_options(action, after_command=True)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= INT_MAX:
        raise argparse.ArgumentTypeError(
            f"invalid limit {visible(repr(text))}: must be an integer from 1 to {INT_MAX}"
        )
    return value


def _ordering_key_arg(text: str) -> str:
    try:
        key = require_ordering_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(visible(str(exc))) from None
    assert key is not None
    return key


def _coalesce_key_arg(text: str) -> str:
    try:
        rule = require_coalesce(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(visible(str(exc))) from None
    assert rule is not None
    return rule.key


def _route_arg(text: str) -> str:
    try:
        return require_route(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(visible(str(exc))) from None


def _time_arg(text: str) -> float:
    try:
        return read_time("time", text, time.time())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(visible(str(exc))) from None


def _busy_timeout(text: str) -> float:
    try:
        return check_busy_timeout(float(text), "--busy-timeout")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(visible(str(exc))) from None


def _status_list(text: str) -> list[str]:
    statuses = [_status_arg(part.strip()) for part in text.split(",") if part.strip()]
    if not statuses:
        raise argparse.ArgumentTypeError(
            f"invalid status list {visible(repr(text))}: name at least one status"
        )
    return statuses


DESTINATIONS_HELP: Final = (
    "each destination (deliver_to) configured, with live rows or with state: its state, "
    "until when and why, rate and starts available, concurrency used/limit, pending, "
    "oldest due, last success and failure (read-only); or show, pause, resume or enable one"
)


def _destinations(destinations: argparse.ArgumentParser) -> None:
    """``destinations`` lists; ``destinations show|pause|resume|enable NAME``
    acts on one. As for ``schedules``, the listing's options are taken after
    an action too."""
    destinations.add_argument(
        "--wide",
        action="store_true",
        help="never cut a column to the terminal's width (output that is not a "
        "terminal is never cut)",
    )
    destinations.set_defaults(action=None)
    actions = destinations.add_subparsers(
        dest="action", metavar="ACTION", required=False, parser_class=_Parser
    )
    for name, help in (
        ("show", "one destination whole: state, policy, counters and its newest audit rows"),
        (
            "pause",
            "pause a destination for every worker: its rows stay pending and consume no "
            "attempt; attempts already running finish",
        ),
        ("resume", "lift a destination's pause for every worker"),
        (
            "enable",
            "close a destination's circuit breaker (disabled, open or half-open) so claims "
            "take its rows again, its failures counted afresh",
        ),
    ):
        action = actions.add_parser(name, help=help, description=help)
        action.add_argument(
            "name", metavar="NAME", type=destination_arg, help="the destination (deliver_to)"
        )
        action.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document"
        )
        if name == "pause":
            end = action.add_mutually_exclusive_group()
            end.add_argument(
                "--for",
                dest="for_seconds",
                type=for_arg,
                metavar="DURATION",
                help="lift the pause by itself after this long (e.g. 30m, 2h; default: "
                "paused until resumed)",
            )
            end.add_argument(
                "--until",
                type=until_arg,
                metavar="TIME",
                help=f"lift the pause by itself at TIME, {UNTIL_HELP}",
            )
            action.set_defaults(for_seconds=None, until=None)
        if name != "show":
            action.add_argument(
                "--reason",
                metavar="TEXT",
                help="why, kept in the destination's audit and shown in its listing",
            )
        _global_options(action, after_command=True)
