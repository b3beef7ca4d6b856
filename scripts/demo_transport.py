#!/usr/bin/env python3
"""A demo transport: `demo_transport.py -- ROUTE`, the payload on stdin.
Routes starting with "offline" always fail; routes starting with "flaky" fail
on their first attempt. Everything else is "delivered" by printing a line.

The "--" before the route keeps a route such as "--help" a route, not an
option; the payload comes on stdin, so no other local user can read it (and
its ack token) in /proc/<pid>/cmdline."""

import argparse
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("route")
route = parser.parse_args().route
payload = json.load(sys.stdin)
attempt = int(os.environ.get("TRIO_DISPATCH_ATTEMPT", "1"))
if route.startswith("offline"):
    sys.exit(f"{route} is not answering")
if route.startswith("flaky") and attempt == 1:
    sys.exit(f"{route} refused the first attempt")
print(f"delivered {payload['kind']} to {route}: {payload['body']}")
