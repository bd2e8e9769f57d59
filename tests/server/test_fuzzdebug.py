import json, random, httpx, faulthandler, sys, time
from tests.server.test_errors import mutate, COMPLETION, CHAT

def test_debug(plain_server, ngram_server):
    rng = random.Random(1234)
    with httpx.Client(timeout=40) as client:
        for i in range(60):
            server, path, base = (
                (plain_server, "/completions", COMPLETION) if i % 2 == 0 else (ngram_server, "/chat/completions", CHAT)
            )
            body = mutate(base, rng)
            request = {"content": json.dumps(body).encode(), "headers": {"Content-Type": "application/json"}}
            faulthandler.dump_traceback_later(12, file=sys.stderr)
            t = time.time()
            try:
                if body.get("stream") is True:
                    with client.stream("POST", f"{server.api_url}{path}", **request) as response:
                        response.read()
                else:
                    response = client.post(f"{server.api_url}{path}", **request)
            finally:
                faulthandler.cancel_dump_traceback_later()
            if time.time() - t > 5:
                print("SLOW", i, round(time.time() - t, 1), body, file=sys.stderr)
