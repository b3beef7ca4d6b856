"""The address guard: every address a webhook host resolves to is checked
before connecting, and the connection goes to the address checked."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

import anyio
import sniffio

if TYPE_CHECKING:
    pass


class AddressRefused(Exception):
    """A webhook host resolved to an address the endpoint may not reach."""


class ResolutionFailed(Exception):
    """A webhook host did not resolve."""


def forbidden(address: str) -> str | None:
    """Why an endpoint without ``allow_private`` may not connect to
    ``address``, or None: anything that is not a public unicast address
    (loopback, private, link-local, multicast, unspecified, shared/CGNAT,
    reserved...), IPv4 carried inside IPv6 (mapped, 6to4, Teredo) judged by
    the IPv4 it carries."""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(
        address.split("%", 1)[0]
    )
    if isinstance(ip, ipaddress.IPv6Address):
        inner = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if inner is not None:
            why = forbidden(str(inner))
            return None if why is None else f"{why} (inside {ip})"
    for kind in ("loopback", "link_local", "multicast", "unspecified", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "site-local"
    if not ip.is_global:
        return "non-public"
    return None


QUIET_HOST: Final = "the endpoint's host"
"""How an error names the host of a URL that carries credentials."""


def guarded_backend(
    private_ok: frozenset[tuple[str, int]], quiet: frozenset[tuple[str, int]] = frozenset()
) -> Any:
    import httpcore

    class GuardedBackend(httpcore.AsyncNetworkBackend):
        """Resolves the host itself, refuses forbidden addresses, then
        connects to the address it checked."""

        def _inner(self) -> httpcore.AsyncNetworkBackend:
            if sniffio.current_async_library() == "trio":
                return httpcore.TrioBackend()
            return httpcore.AnyIOBackend()

        async def connect_tcp(
            self,
            host: str,
            port: int,
            timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
            local_address: str | None = None,
            socket_options: Iterable[Any] | None = None,
        ) -> httpcore.AsyncNetworkStream:
            # The host of a URL with credentials is not echoed: should the
            # URL have been misread, it would be a piece of the password.
            named = QUIET_HOST if (host, port) in quiet else host
            try:
                with anyio.fail_after(timeout):
                    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                raise ResolutionFailed(
                    f"DNS failure: {named} does not resolve ({exc.strerror})"
                ) from None
            except TimeoutError:
                raise ResolutionFailed(f"DNS failure: resolving {named} timed out") from None
            addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
            if (host, port) not in private_ok:
                for address in addresses:
                    why = forbidden(address)
                    if why is not None:
                        where = named if host == address else f"{named} resolves to {address}"
                        raise AddressRefused(
                            f"refused: {where}, a {why} address (allow_private is not set)"
                        )
            failure: Exception | None = None
            for address in addresses:
                try:
                    stream: httpcore.AsyncNetworkStream = await self._inner().connect_tcp(
                        address,
                        port,
                        timeout=timeout,
                        local_address=local_address,
                        socket_options=socket_options,
                    )
                    return stream
                except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                    failure = exc
            assert failure is not None
            raise failure

        async def connect_unix_socket(
            self,
            path: str,
            timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
            socket_options: Iterable[Any] | None = None,
        ) -> httpcore.AsyncNetworkStream:
            raise AddressRefused("refused: unix sockets are not webhook destinations")

        async def sleep(self, seconds: float) -> None:
            await anyio.sleep(seconds)

    return GuardedBackend()
