"""Example lab: echo every message on the durable `echoer` with `await env.echo(id, text)`.

The grader kills the worker before and after an echo, and sends one message late.
"""

import json


async def echo_worker(env) -> None:
    sub = await env.js.pull_subscribe_bind(env.durable("echoer"), env.stream("ECHO"))
    while True:
        try:
            msgs = await sub.fetch(batch=1, timeout=0.25)
        except TimeoutError:
            continue
        for msg in msgs:
            body = json.loads(msg.data)
            await env.echo(body["id"], body["text"])
            await msg.ack_sync()
