#!/usr/bin/env python3
"""A demo transport: argv is (deliver_to, payload). Routes starting with
"offline" always fail; routes starting with "flaky" fail on their first
attempt. Everything else is "delivered" by printing a line."""

import json
import os
import sys

route, payload = sys.argv[1], json.loads(sys.argv[2])
attempt = int(os.environ.get("TRIO_DISPATCH_ATTEMPT", "1"))
if route.startswith("offline"):
    sys.exit(f"{route} is not answering")
if route.startswith("flaky") and attempt == 1:
    sys.exit(f"{route} refused the first attempt")
print(f"delivered {payload['kind']} to {route}: {payload['body']}")
