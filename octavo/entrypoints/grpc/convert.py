"""octavo's values from and to the gRPC messages (octavo.proto): a request's SamplingParams and
structured-output spec, a RequestOutput delta as a GenerateResponse, and the status code that
mirrors an HTTP error."""
from __future__ import annotations

import grpc

from octavo.entrypoints.grpc import octavo_pb2 as pb
from octavo.params import PositionLogprobs, RequestOutput, SamplingParams, StructuredOutputsParams

# HTTP status -> the gRPC status that means the same (499: the client went away)
STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.FAILED_PRECONDITION,
                413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                499: grpc.StatusCode.CANCELLED, 500: grpc.StatusCode.UNAVAILABLE,
                503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}

DEFAULT_MAX_TOKENS = 16  # SamplingParams' own, where the message leaves max_tokens unset


def optional(msg, name: str):
    """A proto3 optional field's value, None where it is unset."""
    return getattr(msg, name) if msg.HasField(name) else None


def structured_outputs(msg: pb.SamplingParams) -> StructuredOutputsParams | None:
    """The spec the message's oneof names (None: no constraint)."""
    if not msg.HasField("structured_outputs"):
        return None
    spec = msg.structured_outputs
    kind = spec.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs: set one of json_schema, json_object, regex, "
                         "choice, grammar, structural_tag")
    value = list(spec.choice.values) if kind == "choice" else getattr(spec, kind)
    field = "json" if kind == "json_schema" else kind
    return StructuredOutputsParams(**{field: value},
                                   disable_any_whitespace=spec.disable_any_whitespace)


def sampling_params(msg: pb.SamplingParams, defaults: SamplingParams,
                    structured: StructuredOutputsParams | None) -> SamplingParams:
    """`defaults` (the model's generation_config) fills what the message leaves unset; the
    checks are SamplingParams' own (ValueError naming the field)."""
    def pick(name: str):
        value = optional(msg, name)
        return getattr(defaults, name) if value is None else value

    max_tokens = optional(msg, "max_tokens")
    return SamplingParams(
        n=pick("n"), best_of=optional(msg, "best_of"), temperature=pick("temperature"),
        top_p=pick("top_p"), top_k=pick("top_k"), min_p=pick("min_p"),
        seed=optional(msg, "seed"), presence_penalty=pick("presence_penalty"),
        frequency_penalty=pick("frequency_penalty"),
        repetition_penalty=pick("repetition_penalty"),
        logit_bias=dict(msg.logit_bias) or None,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else (max_tokens or None),
        min_tokens=pick("min_tokens"), stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos, include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=pick("skip_special_tokens"),
        spaces_between_special_tokens=pick("spaces_between_special_tokens"),
        logprobs=optional(msg, "logprobs"), prompt_logprobs=optional(msg, "prompt_logprobs"),
        allowed_token_ids=list(msg.allowed_token_ids) or None,
        bad_words=list(msg.bad_words) or None,
        truncate_prompt_tokens=optional(msg, "truncate_prompt_tokens"),
        structured_outputs=structured)


def prompt_of(msg) -> str | list[int]:
    """The text or token ids of a message's `prompt` (or `input`) oneof."""
    kind = msg.WhichOneof("prompt" if isinstance(msg, pb.GenerateRequest) else "input")
    if kind is None:
        raise ValueError("prompt: set text or token_ids")
    return msg.text if kind == "text" else list(msg.token_ids.ids)


def _position(position: PositionLogprobs | None) -> pb.PositionLogprobs:
    return pb.PositionLogprobs(entries=[
        pb.TopLogprob(token_id=token, logprob=lp.logprob, rank=lp.rank,
                      token=lp.decoded_token or "")
        for token, lp in (position or {}).items()])


class ResponseBuilder:
    """One Generate call's responses: each RequestOutput delta with what is new (the prompt's
    token ids and logprobs as they come), the usage on the last."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt_positions_sent = 0
        self.completion_tokens = 0
        self.first = True

    def response(self, out: RequestOutput) -> pb.GenerateResponse | None:
        """None where the delta holds nothing new."""
        reply = pb.GenerateResponse(request_id=self.request_id, finished=out.finished)
        if self.first:
            reply.prompt_token_ids.extend(out.prompt_token_ids)
        positions = out.prompt_logprobs or []
        reply.prompt_logprobs.extend(_position(p)
                                     for p in positions[self.prompt_positions_sent:])
        self.prompt_positions_sent = len(positions)
        for c in out.outputs:
            if not c.text and not c.token_ids and c.finish_reason is None:
                continue
            self.completion_tokens += len(c.token_ids)
            choice = reply.choices.add(index=c.index, text=c.text, token_ids=c.token_ids,
                                       finish_reason=c.finish_reason or "")
            choice.logprobs.extend(_position(p) for p in c.logprobs or [])
            if isinstance(c.stop_reason, str):
                choice.stop_string = c.stop_reason
            elif c.stop_reason is not None:
                choice.stop_token_id = c.stop_reason
        if out.finished:
            reply.usage.CopyFrom(pb.Usage(prompt_tokens=len(out.prompt_token_ids),
                                          completion_tokens=self.completion_tokens,
                                          cached_tokens=out.num_cached_tokens))
        if not (self.first or reply.choices or reply.prompt_logprobs or out.finished):
            return None
        self.first = False
        return reply
