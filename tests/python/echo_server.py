#!/usr/bin/env python3
"""A tiny Python server of tandem.v1.Generation, used only to test client.py.

It is a test fixture for the harness, not a model: `Generate` answers with the
prompt's UTF-8 bytes as token ids (one delta per byte, up to max_tokens) and
then one Finished message, so the client's whole path (reflection, health,
streaming, Finished) can be checked without `tandem serve`. It binds
127.0.0.1 on a free port, prints {"port": N} on stdout and serves until killed.
"""

import json
import sys
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.v1 import generate_pb2, generate_pb2_grpc

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class Echo(generate_pb2_grpc.GenerationServicer):
    def Generate(self, request, context):
        start = time.monotonic()
        if request.WhichOneof("prompt") == "text":
            ids = list(request.text.encode("utf-8"))
        elif request.WhichOneof("prompt") == "token_ids":
            ids = list(request.token_ids.ids)
        else:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a prompt is required")
        if request.HasField("max_tokens") and request.max_tokens == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be > 0")
        limit = request.max_tokens if request.HasField("max_tokens") else len(ids)
        out = ids[:limit]
        reason = (
            generate_pb2.FINISH_REASON_LENGTH
            if len(out) < len(ids)
            else generate_pb2.FINISH_REASON_STOP
        )
        rid = request.request_id or "echo-1"
        for i, tok in enumerate(out):
            yield generate_pb2.GenerateResponse(
                request_id=rid,
                delta=generate_pb2.TokenDelta(
                    index=0,
                    token_ids=[tok],
                    text=chr(tok) if tok < 128 else "",
                    finish_reason=reason if i == len(out) - 1 else 0,
                ),
            )
        elapsed = time.monotonic() - start
        yield generate_pb2.GenerateResponse(
            request_id=rid,
            finished=generate_pb2.Finished(
                choices=[
                    generate_pb2.ChoiceSummary(
                        index=0, finish_reason=reason, completion_tokens=len(out)
                    )
                ],
                usage=generate_pb2.Usage(
                    prompt_tokens=len(ids), completion_tokens=len(out)
                ),
                timings=generate_pb2.Timings(ttft_s=elapsed, e2e_s=elapsed),
            ),
        )


def main():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    generate_pb2_grpc.add_GenerationServicer_to_server(Echo(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(json.dumps({"port": port}), flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    sys.exit(main())
