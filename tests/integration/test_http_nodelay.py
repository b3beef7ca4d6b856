"""The dashboard's listener under asyncio: asyncio turns Nagle off only on
a connection whose socket says IPPROTO_TCP, and hypercorn adds nothing, so
a listener made with protocol 0 answers each keep-alive request about 40 ms
late (its response's last segment waits on the client's delayed ACK)."""

from __future__ import annotations

import asyncio
import socket

from trio_dispatch.web import parse_listen
from trio_dispatch.web.server import ConnectionGate, _capped, bind


def test_a_connection_the_asyncio_server_accepts_sends_without_nagle_delay() -> None:
    async def main() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = _capped(bind(parse_listen("test", "127.0.0.1:0")), ConnectionGate(4))
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            port = listener.getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                return await asyncio.wait_for(accepted, 10)
            finally:
                writer.close()
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) != 0
