"""Drives tandem's agent APIs with the official `openai` and `anthropic` SDKs.

Usage: agent_client.py --base-url http://HOST:PORT --model NAME [--runs N]

Tool calling (OpenAI chat: required, named, streamed, a tool-result round
trip; Anthropic Messages: tool_use, streamed, tool_result), reasoning split
into `reasoning_content`, stop sequences, count_tokens and the 400s of bad
input. Prints one JSON object per case; the Rust test (cli/tests/agents.rs)
checks them. Any unexpected exception fails the script (non-zero exit).
"""

import argparse
import json

import anthropic
import jsonschema
import openai

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": TIME}},
]
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER},
    {"name": "get_time", "description": "The time now", "input_schema": TIME},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# Anthropic's SDK no longer sends sampling parameters; the server still
# reads them (older clients send them), so greedy runs ask in the body. The
# default is temperature 1.
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the weather in Oslo for the next 3 days?"}]


def emit(case, **fields):
    print(json.dumps({"case": case, **fields}), flush=True)


def valid_call(name, arguments):
    """Whether a call names a tool and its arguments (JSON text) validate."""
    if name not in SCHEMAS:
        return False
    try:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def openai_error(case, fn):
    try:
        fn()
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        emit(case, status=e.status_code, error=body)
        return
    raise AssertionError(f"{case}: expected an error")


def anthropic_error(case, fn):
    try:
        fn()
    except anthropic.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        emit(case, status=e.status_code, error=body)
        return
    raise AssertionError(f"{case}: expected an error")


def stream_calls(chunks):
    """Reassembles streamed tool-call deltas: {index: [id, name, arguments]}."""
    calls, fragments, content, finish = {}, 0, "", None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, ["", "", ""])
                if tc.id:
                    call[0] = tc.id
                if tc.function and tc.function.name:
                    call[1] += tc.function.name
                if tc.function and tc.function.arguments:
                    call[2] += tc.function.arguments
                    fragments += 1
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], fragments, content, finish


def openai_cases(client, model, runs):
    kw = dict(model=model, messages=ASK, tools=OPENAI_TOOLS, max_tokens=320)
    valid, finishes, names, first = 0, set(), set(), None
    for seed in range(runs):
        r = client.chat.completions.create(**kw, tool_choice="required", parallel_tool_calls=False,
                                           temperature=1, seed=seed)
        msg = r.choices[0].message
        finishes.add(r.choices[0].finish_reason)
        for tc in msg.tool_calls or []:
            names.add(tc.function.name)
        calls = msg.tool_calls or []
        if len(calls) == 1 and valid_call(calls[0].function.name, calls[0].function.arguments):
            valid += 1
            first = first or (r, calls[0])
    emit("openai_required", runs=runs, valid=valid, finish_reasons=sorted(finishes), names=sorted(names))

    r = client.chat.completions.create(**kw, temperature=1, seed=3,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    tc = r.choices[0].message.tool_calls[0]
    emit("openai_named", name=tc.function.name, valid=valid_call(tc.function.name, tc.function.arguments),
         finish_reason=r.choices[0].finish_reason)

    # Streamed and unstreamed, same seed: the deltas reassemble byte-exactly.
    for parallel in (False, True):
        args = dict(kw, tool_choice="required", parallel_tool_calls=parallel, temperature=1, seed=11)
        whole = client.chat.completions.create(**args)
        calls, fragments, content, finish = stream_calls(client.chat.completions.create(**args, stream=True))
        whole_calls = whole.choices[0].message.tool_calls
        emit("openai_stream", parallel=parallel,
             whole=[[tc.function.name, tc.function.arguments] for tc in whole_calls],
             whole_finish=whole.choices[0].finish_reason,
             streamed=[[name, arguments] for _, name, arguments in calls],
             ids_ok=all(i.startswith("call_") for i, _, _ in calls)
             and all(tc.id.startswith("call_") for tc in whole_calls),
             fragments=fragments, content=content, finish=finish)

    # The tool's answer goes back and the conversation continues.
    r, call = first
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": -3})},
    ]
    again = client.chat.completions.create(model=model, messages=history, tools=OPENAI_TOOLS,
                                           tool_choice="none", max_tokens=8, temperature=0)
    emit("openai_round_trip", finish_reason=again.choices[0].finish_reason,
         content=again.choices[0].message.content, calls=again.choices[0].message.tool_calls,
         prompt_tokens=again.usage.prompt_tokens, first_prompt_tokens=r.usage.prompt_tokens)

    # Reasoning: a grammar makes the random model think out loud.
    think = dict(model=model, messages=ASK, max_tokens=64, temperature=1, seed=5,
                 extra_body={"structured_outputs": {"regex": "<think>[a-z ]{3,16}</think>\n\n[a-z ]{3,16}"}})
    whole = client.chat.completions.create(**think).choices[0].message.model_dump()
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**think, stream=True):
        for choice in chunk.choices:
            extra = choice.delta.model_dump()
            reasoning += extra.get("reasoning_content") or ""
            content += extra.get("content") or ""
    emit("openai_reasoning", reasoning=whole.get("reasoning_content"), content=whole.get("content"),
         stream_reasoning=reasoning, stream_content=content)

    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "strnig"}}}}}]
    openai_error("openai_bad_schema", lambda: client.chat.completions.create(
        model=model, messages=ASK, tools=bad_schema, max_tokens=4))
    openai_error("openai_unknown_choice", lambda: client.chat.completions.create(
        model=model, messages=ASK, tools=OPENAI_TOOLS, max_tokens=4,
        tool_choice={"type": "function", "function": {"name": "launch_rocket"}}))
    openai_error("openai_unknown_tool_call_id", lambda: client.chat.completions.create(
        model=model, max_tokens=4, tools=OPENAI_TOOLS,
        messages=ASK + [{"role": "tool", "tool_call_id": "call_nobody", "content": "1"}]))
    openai_error("openai_tools_and_format", lambda: client.chat.completions.create(
        model=model, messages=ASK, tools=OPENAI_TOOLS, max_tokens=4, tool_choice="required",
        response_format={"type": "json_object"}))


RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"],
                    "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in OPENAI_TOOLS]


def without_ids(items):
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def responses_cases(client, model, runs):
    valid = 0
    for seed in range(runs):
        r = client.responses.create(model=model, input=ASK, tools=RESPONSES_TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=160, temperature=1,
                                    extra_body={"seed": seed})
        calls = [o for o in r.output if o.type == "function_call"]
        if len(calls) == 1 and valid_call(calls[0].name, calls[0].arguments):
            valid += 1
    emit("responses_required", runs=runs, valid=valid)

    for name, args in [
        ("text", dict(input="Tell me about foxes.", instructions="Be terse.", max_output_tokens=24)),
        ("tools", dict(input=ASK, tools=RESPONSES_TOOLS, tool_choice="required", max_output_tokens=160)),
    ]:
        whole = client.responses.create(model=model, temperature=0, **args)
        events, deltas, final = [], {}, None
        for event in client.responses.create(model=model, temperature=0, stream=True, **args):
            events.append(event.type)
            if event.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
                deltas[event.output_index] = deltas.get(event.output_index, "") + event.delta
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        items = final.model_dump()["output"]
        reassembled = [deltas.get(i, "") == (item.get("arguments") if item["type"] == "function_call"
                                             else item["content"][0]["text"])
                       for i, item in enumerate(items)]
        emit("responses_" + name, whole=without_ids(whole.model_dump()["output"]),
             streamed=without_ids(items), status=whole.status, stream_status=final.status,
             output_text=whole.output_text, events=events, reassembled=reassembled,
             usage=whole.usage.model_dump(), stream_usage=final.usage.model_dump())
        if name == "tools":
            call = [o for o in whole.output if o.type == "function_call"][0]
            again = client.responses.create(model=model, temperature=0, max_output_tokens=8, tools=RESPONSES_TOOLS,
                                            tool_choice="none", input=ASK + [
                                                {"type": "function_call", "call_id": call.call_id,
                                                 "name": call.name, "arguments": call.arguments},
                                                {"type": "function_call_output", "call_id": call.call_id,
                                                 "output": "-3C"}])
            emit("responses_round_trip", status=again.status, types=[o.type for o in again.output],
                 input_tokens=again.usage.input_tokens, first_input_tokens=whole.usage.input_tokens)

    openai_error("responses_stored", lambda: client.responses.create(
        model=model, input="hi", previous_response_id="resp_123"))
    openai_error("responses_orphan_output", lambda: client.responses.create(
        model=model, input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}]))


def tool_use_blocks(message):
    return [b for b in message.content if b.type == "tool_use"]


def anthropic_cases(client, model, runs):
    kw = dict(model=model, max_tokens=160, messages=ASK, tools=ANTHROPIC_TOOLS)
    valid, reasons, first = 0, set(), None
    for _ in range(runs):
        m = client.messages.create(**kw, tool_choice={"type": "any", "disable_parallel_tool_use": True})
        reasons.add(m.stop_reason)
        uses = tool_use_blocks(m)
        if len(uses) == 1 and valid_call(uses[0].name, json.dumps(uses[0].input)):
            valid += 1
            first = first or (m, uses[0])
    emit("anthropic_tools", runs=runs, valid=valid, stop_reasons=sorted(reasons))

    # Greedy, streamed and not: the same blocks.
    args = dict(kw, tool_choice={"type": "any"}, extra_body=GREEDY)
    whole = client.messages.create(**args)
    events = []
    with client.messages.stream(**args) as stream:
        for event in stream:
            events.append(event.type)
        streamed = stream.get_final_message()
    def blocks(message):
        return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in message.content]

    emit("anthropic_stream", whole=blocks(whole), streamed=blocks(streamed),
         ids_ok=all(b.id.startswith("toolu_") for b in tool_use_blocks(whole) + tool_use_blocks(streamed)),
         whole_stop=whole.stop_reason,
         stream_stop=streamed.stop_reason, events=events,
         usage=whole.usage.model_dump(), stream_usage=streamed.usage.model_dump())

    m, use = first
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "-3C, snow"}]}]},
    ]
    again = client.messages.create(model=model, max_tokens=8, messages=history, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "none"}, extra_body=GREEDY)
    emit("anthropic_round_trip", stop_reason=again.stop_reason, types=[b.type for b in again.content],
         input_tokens=again.usage.input_tokens, first_input_tokens=m.usage.input_tokens)

    # Text, stop sequences and token counts.
    plain = dict(model=model, max_tokens=24, messages=ASK, extra_body=GREEDY,
                 system="You are terse.")
    text = client.messages.create(**plain)
    with client.messages.stream(**plain) as stream:
        streamed_text = "".join(stream.text_stream)
    full = text.content[0].text if text.content else ""
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.messages.create(**plain, stop_sequences=["\u2603never", stop])
    count = client.messages.count_tokens(model=model, messages=ASK, system="You are terse.")
    emit("anthropic_text", text=full, streamed=streamed_text, stop_reason=text.stop_reason,
         stop=stop, cut=cut.content[0].text if cut.content else "", cut_reason=cut.stop_reason,
         cut_sequence=cut.stop_sequence, input_tokens=text.usage.input_tokens,
         counted=count.input_tokens)

    anthropic_error("anthropic_unknown_tool_use_id", lambda: client.messages.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nobody", "content": "1"}]}]))
    anthropic_error("anthropic_tool_use_in_user_turn", lambda: client.messages.create(
        model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}]}]))
    anthropic_error("anthropic_bad_schema", lambda: client.messages.create(
        model=model, max_tokens=4, messages=ASK,
        tools=[{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": 7}}}}]))
    anthropic_error("anthropic_unknown_model", lambda: client.messages.create(
        model="claude-nope", max_tokens=4, messages=ASK))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", type=int, default=50)
    a = ap.parse_args()
    oa = openai.OpenAI(base_url=f"{a.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    openai_cases(oa, a.model, a.runs)
    responses_cases(oa, a.model, min(a.runs, 10))
    an = anthropic.Anthropic(base_url=a.base_url, api_key="unused", max_retries=0, timeout=120)
    anthropic_cases(an, a.model, min(a.runs, 10))


if __name__ == "__main__":
    main()
