"""Drives tandem's OpenAI-compatible HTTP API with the official `openai` SDK.

Usage: openai_client.py --base-url http://HOST:PORT/v1 --model NAME
                        --prompt TEXT --user-message TEXT --max-tokens N

Runs a fixed suite of calls and prints one JSON object per case on stdout;
the Rust test (cli/tests/openai.rs) compares them with the gRPC path and
checks their shapes. Any exception fails the script (non-zero exit).
"""

import argparse
import json
import urllib.error
import urllib.request

import openai


def emit(case, **fields):
    print(json.dumps({"case": case, **fields}), flush=True)


def error_case(case, fn):
    """Runs fn, which must raise an openai.APIStatusError."""
    try:
        fn()
    except openai.APIStatusError as e:
        # The SDK unwraps the `error` object of the body.
        body = e.body if isinstance(e.body, dict) else {}
        emit(case, status=e.status_code, error=body)
        return
    raise AssertionError(f"{case}: expected an error")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--user-message", required=True)
    ap.add_argument("--max-tokens", type=int, default=16)
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key="unused", max_retries=0, timeout=120)

    models = client.models.list()
    emit("models", ids=[m.id for m in models.data])
    emit("model_retrieve", id=client.models.retrieve(a.model).id)
    error_case("unknown_model_retrieve", lambda: client.models.retrieve("no-such-model"))

    # vLLM's /tokenize and /detokenize (beside /v1, as vLLM serves them).
    root = a.base_url.rsplit("/v1", 1)[0]
    def post_root(path, body):
        req = urllib.request.Request(root + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())
    t = post_root("/tokenize", {"model": a.model, "prompt": a.prompt, "return_token_strs": True})
    emit("tokenize_prompt", **t)
    emit("tokenize_chat", **post_root("/tokenize", {
        "model": a.model, "messages": [{"role": "user", "content": a.user_message}]}))
    emit("detokenize", **post_root("/detokenize", {"model": a.model, "tokens": t["tokens"]}))

    # Completions, greedy: not streamed, then streamed.
    r = client.completions.create(model=a.model, prompt=a.prompt, max_tokens=a.max_tokens, temperature=0)
    emit("completion", text=r.choices[0].text, finish_reason=r.choices[0].finish_reason,
         usage=r.usage.model_dump())
    chunks = list(client.completions.create(model=a.model, prompt=a.prompt, max_tokens=a.max_tokens,
                                            temperature=0, stream=True))
    emit("completion_stream", text="".join(c.choices[0].text for c in chunks if c.choices),
         chunks=len(chunks), finish_reason=[c.choices[0].finish_reason for c in chunks if c.choices][-1])

    # Chat, greedy: not streamed, then streamed with usage.
    messages = [{"role": "user", "content": a.user_message}]
    r = client.chat.completions.create(model=a.model, messages=messages, max_tokens=a.max_tokens,
                                       temperature=0)
    emit("chat", text=r.choices[0].message.content, role=r.choices[0].message.role,
         finish_reason=r.choices[0].finish_reason, usage=r.usage.model_dump())
    chunks = list(client.chat.completions.create(model=a.model, messages=messages,
                                                 max_completion_tokens=a.max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    content = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    roles = [c.choices[0].delta.role for c in chunks if c.choices and c.choices[0].delta.role]
    emit("chat_stream", text=content, roles=roles,
         usage=chunks[-1].usage.model_dump() if chunks[-1].usage else None,
         last_choices=len(chunks[-1].choices))

    # n samples with a seed: reproducible, one choice per index.
    def sampled():
        r = client.completions.create(model=a.model, prompt=a.prompt, max_tokens=8, n=3, seed=7,
                                      temperature=1.0, top_p=0.9)
        return [(c.index, c.text) for c in sorted(r.choices, key=lambda c: c.index)]
    first, again = sampled(), sampled()
    emit("n_seed", indices=[i for i, _ in first], texts=[t for _, t in first],
         same_again=first == again)

    # Logprobs on both endpoints.
    r = client.completions.create(model=a.model, prompt=a.prompt, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    emit("completion_logprobs", tokens=lp.tokens, token_logprobs=lp.token_logprobs,
         top=[len(t) for t in lp.top_logprobs])
    r = client.chat.completions.create(model=a.model, messages=messages, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    emit("chat_logprobs", tokens=[c.token for c in content], logprobs=[c.logprob for c in content],
         top=[len(c.top_logprobs) for c in content])

    # Prompt scoring: echo (with logprobs, the prompt's tokens first) and
    # vLLM's prompt_logprobs, on both endpoints, streamed and not.
    r = client.completions.create(model=a.model, prompt=a.prompt, max_tokens=4, temperature=0,
                                  echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    emit("echo", text=r.choices[0].text, tokens=lp.tokens, token_logprobs=lp.token_logprobs,
         top=[None if t is None else len(t) for t in lp.top_logprobs], text_offset=lp.text_offset)
    chunks = list(client.completions.create(model=a.model, prompt=a.prompt, max_tokens=4,
                                            temperature=0, echo=True, stream=True))
    emit("echo_stream", text="".join(c.choices[0].text for c in chunks if c.choices),
         first=chunks[0].choices[0].text)
    r = client.completions.create(model=a.model, prompt=a.prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    emit("prompt_logprobs", scores=r.choices[0].model_dump()["prompt_logprobs"])
    r = client.chat.completions.create(model=a.model, messages=messages, max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 0})
    streamed = None
    for chunk in client.chat.completions.create(model=a.model, messages=messages, max_tokens=2,
                                                temperature=0, stream=True,
                                                extra_body={"prompt_logprobs": 0}):
        for c in chunk.choices:
            streamed = c.model_dump().get("prompt_logprobs") or streamed
    emit("chat_prompt_logprobs", scores=r.choices[0].model_dump()["prompt_logprobs"], streamed=streamed)

    # A stop string cuts the text before it.
    full = client.completions.create(model=a.model, prompt=a.prompt, max_tokens=a.max_tokens,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = client.completions.create(model=a.model, prompt=a.prompt, max_tokens=a.max_tokens,
                                  temperature=0, stop=[stop])
    emit("stop", full=full, stop=stop, text=r.choices[0].text, finish_reason=r.choices[0].finish_reason)

    # Structured output: a JSON schema (OpenAI's response_format) and a
    # choice list (vLLM's structured_outputs), sampled at temperature 1.
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=a.model, messages=messages, max_tokens=200, temperature=1.0, seed=3,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema, "strict": True}})
    emit("json_schema", text=r.choices[0].message.content, finish_reason=r.choices[0].finish_reason)
    r = client.completions.create(model=a.model, prompt=a.prompt, max_tokens=20, temperature=1.0,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    emit("choice", text=r.choices[0].text, finish_reason=r.choices[0].finish_reason)
    error_case("bad_schema", lambda: client.chat.completions.create(
        model=a.model, messages=messages,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}))

    # Beam search (vLLM's use_beam_search): the 2 best of 3 beams, each
    # choice whole at the end, streamed or not.
    beam = {"use_beam_search": True, "best_of": 3, "ignore_eos": True}
    r = client.completions.create(model=a.model, prompt=a.prompt, max_tokens=6, temperature=0, n=2,
                                  logprobs=0, extra_body=beam)
    streamed = ["", ""]
    for chunk in client.completions.create(model=a.model, prompt=a.prompt, max_tokens=6, n=2,
                                           stream=True, extra_body=beam):
        for c in chunk.choices:
            streamed[c.index] += c.text
    emit("beams", texts=[c.text for c in r.choices], indices=[c.index for c in r.choices],
         sums=[sum(c.logprobs.token_logprobs) for c in r.choices], streamed=streamed)
    error_case("bad_best_of", lambda: client.completions.create(
        model=a.model, prompt=a.prompt, n=1, extra_body={"best_of": 2}))
    error_case("beam_temperature", lambda: client.completions.create(
        model=a.model, prompt=a.prompt, temperature=0.5, extra_body={"use_beam_search": True}))

    # Errors: the SDK raises typed errors from OpenAI-shaped bodies.
    error_case("unknown_model", lambda: client.completions.create(model="no-such-model", prompt="x"))
    error_case("bad_temperature", lambda: client.chat.completions.create(
        model=a.model, messages=messages, temperature=5))
    error_case("bad_max_tokens", lambda: client.completions.create(
        model=a.model, prompt=a.prompt, max_tokens=0))
    # The engine's refusals name the field as the endpoint spells it.
    error_case("long_max_tokens", lambda: client.completions.create(
        model=a.model, prompt=a.prompt, max_tokens=10_000_000))
    error_case("long_completion_tokens", lambda: client.chat.completions.create(
        model=a.model, messages=messages, max_completion_tokens=10_000_000))
    error_case("long_messages", lambda: client.chat.completions.create(
        model=a.model, messages=[{"role": "user", "content": "to be or not " * 4000}], max_tokens=4))
    error_case("bad_role", lambda: client.chat.completions.create(
        model=a.model, messages=[{"role": "wizard", "content": "x"}]))
    req = urllib.request.Request(a.base_url + "/completions", data=b'{"model": "x", "prompt": ',
                                 headers={"content-type": "application/json"}, method="POST")
    try:
        urllib.request.urlopen(req, timeout=60)
        raise AssertionError("malformed JSON was accepted")
    except urllib.error.HTTPError as e:
        emit("malformed_json", status=e.code, error=json.loads(e.read())["error"])


if __name__ == "__main__":
    main()
