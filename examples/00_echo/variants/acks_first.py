"""Acks before it echoes: a kill in between loses the message.

Expect: fail every_message_echoed
Says: never echoed
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
            await msg.ack_sync()
            body = json.loads(msg.data)
            await env.echo(body["id"], body["text"])
