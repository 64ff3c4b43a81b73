"""Returns on an empty fetch: the late message finds no worker.

Expect: fail survives_idle, no_unplanned_deaths
Says: returned on its own
"""

import json


async def echo_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("echoer"), env.stream("ECHO"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.25)
        except TimeoutError:
            return
        for msg in msgs:
            body = json.loads(msg.data)
            await env.echo(body["id"], body["text"])
            await msg.ack_sync()
