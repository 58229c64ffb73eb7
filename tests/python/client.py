#!/usr/bin/env python3
"""A gRPC client of tandem's public API, for the integration tests.

It runs with the Python stubs generated from `proto/tandem/v1/generate.proto`
by grpcio-tools on PYTHONPATH (the Rust harness in `tests/src/python.rs` makes
the venv and sets it). Every result goes to stdout as one JSON object per line
so the tests can parse it; failures go to stderr and exit non-zero.

Modes:
  reflect   list the server's services through gRPC server reflection
            (grpc.reflection.v1alpha): {"services": [...]}; with --symbol also
            describe that service's methods: {"service": ..., "methods": [...]}
  health    grpc.health.v1.Health/Check for each --service (default: "" and
            "tandem.v1.Generation"): {"service": ..., "status": "SERVING"}
  generate  call tandem.v1.Generation/Generate and print each streamed
            GenerateResponse as JSON (proto field names, enums by name, every
            field present), e.g. {"request_id": ..., "delta": {...}} and, last,
            {"request_id": ..., "finished": {...}}
"""

import argparse
import json
import sys

import grpc
from google.protobuf import descriptor_pb2, json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tandem.v1 import generate_pb2, generate_pb2_grpc

GENERATION_SERVICE = "tandem.v1.Generation"

# Exit statuses, so a test can tell a failed RPC from a bad invocation.
EXIT_RPC_ERROR = 2
EXIT_PROTOCOL_ERROR = 3


class ProtocolError(Exception):
    """The server answered, but not as the API says it must."""


def emit(obj):
    print(json.dumps(obj, sort_keys=True), flush=True)


def to_dict(message):
    return json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )


def connect(args):
    channel = grpc.insecure_channel(args.addr)
    try:
        grpc.channel_ready_future(channel).result(timeout=args.connect_timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        raise ConnectionError(
            f"could not connect to {args.addr} within {args.connect_timeout}s"
        ) from None
    return channel


def reflection_call(stub, request, timeout):
    responses = list(stub.ServerReflectionInfo(iter([request]), timeout=timeout))
    if len(responses) != 1:
        raise ProtocolError(f"expected one reflection response, got {len(responses)}")
    response = responses[0]
    if response.HasField("error_response"):
        err = response.error_response
        raise ProtocolError(f"reflection error {err.error_code}: {err.error_message}")
    return response


def run_reflect(channel, args):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    response = reflection_call(
        stub, reflection_pb2.ServerReflectionRequest(list_services=""), args.timeout
    )
    names = sorted(s.name for s in response.list_services_response.service)
    emit({"services": names})
    if args.symbol:
        response = reflection_call(
            stub,
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=args.symbol),
            args.timeout,
        )
        package, _, name = args.symbol.rpartition(".")
        for raw in response.file_descriptor_response.file_descriptor_proto:
            file = descriptor_pb2.FileDescriptorProto.FromString(raw)
            if file.package != package:
                continue
            for service in file.service:
                if service.name == name:
                    emit(
                        {
                            "service": args.symbol,
                            "file": file.name,
                            "methods": [
                                {
                                    "name": m.name,
                                    "input_type": m.input_type,
                                    "output_type": m.output_type,
                                    "client_streaming": m.client_streaming,
                                    "server_streaming": m.server_streaming,
                                }
                                for m in service.method
                            ],
                        }
                    )
                    return
        raise ProtocolError(f"reflection returned no descriptor for {args.symbol}")


def run_health(channel, args):
    stub = health_pb2_grpc.HealthStub(channel)
    services = args.service if args.service is not None else ["", GENERATION_SERVICE]
    for service in services:
        response = stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=args.timeout
        )
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        emit({"service": service, "status": status})


def build_request(args):
    sampling = generate_pb2.SamplingParams(temperature=args.temperature)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.top_k is not None:
        sampling.top_k = args.top_k
    if args.seed is not None:
        sampling.seed = args.seed
    request = generate_pb2.GenerateRequest(
        request_id=args.request_id,
        sampling=sampling,
        n=args.n,
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
    )
    if args.token_ids is not None:
        ids = [int(t) for t in args.token_ids.split(",") if t.strip()]
        request.token_ids.CopyFrom(generate_pb2.TokenIds(ids=ids))
    else:
        request.text = args.prompt
    if args.max_tokens is not None:
        request.max_tokens = args.max_tokens
    if args.logprobs is not None:
        request.logprobs = args.logprobs
    return request


def run_generate(channel, args):
    stub = generate_pb2_grpc.GenerationStub(channel)
    call = stub.Generate(build_request(args), timeout=args.timeout)
    deltas = 0
    finished = False
    for response in call:
        if finished:
            raise ProtocolError("a message followed the Finished message")
        emit(to_dict(response))
        kind = response.WhichOneof("event")
        if kind == "finished":
            finished = True
        elif kind == "delta":
            deltas += 1
            if args.cancel_after is not None and deltas >= args.cancel_after:
                call.cancel()
                emit({"cancelled": True, "deltas": deltas})
                return
        else:
            raise ProtocolError("a GenerateResponse with no event")
    if not finished:
        raise ProtocolError("the stream ended without a Finished message")


def parse_args(argv):
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--addr", required=True, help="server address, host:port")
    common.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the channel to become ready",
    )
    common.add_argument(
        "--timeout", type=float, default=60.0, help="deadline of each RPC, seconds"
    )
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    modes = parser.add_subparsers(dest="mode", required=True)

    reflect = modes.add_parser(
        "reflect", parents=[common], help="list services via server reflection"
    )
    reflect.add_argument("--symbol", help="also describe this service's methods")

    health = modes.add_parser("health", parents=[common], help="grpc.health.v1 Check")
    health.add_argument(
        "--service",
        action="append",
        help='service to check (repeatable; default: "" and tandem.v1.Generation)',
    )

    gen = modes.add_parser("generate", parents=[common], help="stream one Generate call")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text prompt")
    prompt.add_argument("--token-ids", help="comma-separated prompt token ids")
    gen.add_argument("--request-id", default="")
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--stop-token-id", type=int, action="append", default=[])
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--logprobs", type=int)
    gen.add_argument(
        "--cancel-after",
        type=int,
        help="cancel the call after this many delta messages",
    )
    return parser.parse_args(argv)


def main(argv):
    args = parse_args(argv)
    run = {"reflect": run_reflect, "health": run_health, "generate": run_generate}
    try:
        with connect(args) as channel:
            run[args.mode](channel, args)
    except grpc.RpcError as e:
        print(
            json.dumps({"rpc_error": e.code().name, "details": e.details()}),
            file=sys.stderr,
        )
        return EXIT_RPC_ERROR
    except (ProtocolError, ConnectionError) as e:
        print(json.dumps({"error": str(e)}), file=sys.stderr)
        return EXIT_PROTOCOL_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
