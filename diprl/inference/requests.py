"""Complete validation of generation requests, before anything reaches the engine.

A request that the engine cannot serve must fail alone, with an error its client can act on. vLLM
checks less than it needs (a token id `True` is an int; a legal-orders payload that parses can
still make the order constraint raise inside the engine's busy loop and kill it for every later
request), so everything is checked here, exactly: types (a bool is not an int), ranges against
the engine's real limits (context length, vocabulary, finite temperature), and legal orders that
are consistent with their own locations and phase and leave something to order.

`validate_request` returns a `ValidRequest` or raises `RequestError` naming the field (or
`InvalidAdapterName` for a policy that is not `base` / `<policy>@v<N>`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diprl.game.legal import PhaseKind, PowerOrders
from diprl.inference.adapters import model_ref
from diprl.messages import PolicyRef, UnknownPolicyRef

REQUEST_KEYS = frozenset(
    {"policy", "prompt", "legal", "temperature", "max_tokens", "reasoning_max_tokens", "request_id", "sample_seed"}
)
DEFAULT_TEMPERATURE = 1.0
DEFAULT_MAX_TOKENS = 384
MIN_TEMPERATURE = 0.01
"""Below this (other than exactly 0, greedy decoding for evaluation), logits / t overflows float32 for
ordinary logits; the learner never trains on greedy completions (no importance ratio to model)."""
MAX_TEMPERATURE = 100.0
"""Above this every legal order is equally likely already; larger values are typos (1e308 was sent)."""
MAX_REQUEST_ID = 128
POWERS = frozenset({"AUSTRIA", "ENGLAND", "FRANCE", "GERMANY", "ITALY", "RUSSIA", "TURKEY"})
MAX_LOCATIONS = 34  # more units or build sites than supply centres cannot exist
MAX_ORDERS_PER_LOCATION = 512
MAX_ORDER_CHARS = 64

_LOC = r"[A-Z]{3}(?:/[NSEW]C)?"
_LOC_RE = re.compile(_LOC)
_PHASE_RE = re.compile(r"[SFW][0-9]{4}[MRA]")
_ORDER_RE = {
    PhaseKind.MOVEMENT: re.compile(
        rf"[AF] ({_LOC}) (?:H|- {_LOC}(?: VIA)?|S [AF] {_LOC}(?: - {_LOC})?|C A {_LOC} - {_LOC})"
    ),
    PhaseKind.RETREAT: re.compile(rf"[AF] ({_LOC}) (?:R {_LOC}|D)"),
    PhaseKind.BUILD: re.compile(rf"[AF] ({_LOC}) B"),
    PhaseKind.DISBAND: re.compile(rf"[AF] ({_LOC}) D"),
}
_LEGAL_KEYS = frozenset({"power", "phase", "kind", "n_required", "by_loc"})


class RequestError(ValueError):
    """A malformed generation request; the message names the field and what it must be."""


@dataclass(frozen=True)
class EngineLimits:
    """What the running engine can take: checked against every request."""

    max_model_len: int
    vocab_size: int  # token ids a prompt may hold: 0 <= id < vocab_size (the tokenizer's ids)


@dataclass(frozen=True)
class ValidRequest:
    policy: str
    prompt: str | tuple[int, ...]
    legal: PowerOrders | None
    temperature: float
    max_tokens: int
    reasoning_max_tokens: int | None
    request_id: str | None
    sample_seed: int | None = None  # drawn in our logits processor, reproducibly (evaluation only)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _check_text(value: str, what: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(f"{what} is not valid unicode: {err.reason} at character {err.start}") from None


def validate_batch(requests: Any, max_batch: int) -> Sequence[Any]:
    """The batch itself: a list (or tuple) of requests. A string or a dict is not a batch."""
    if not isinstance(requests, list | tuple):
        raise RequestError(
            f"generate takes a list of request dicts, got {_describe(requests)} "
            "(wrap a single request in a list: generate([request]))"
        )
    if len(requests) > max_batch:
        raise RequestError(f"a batch holds at most {max_batch} requests (max_batch), got {len(requests)}")
    return requests


def validate_request(request: Any, limits: EngineLimits) -> ValidRequest:
    """Every field of one request checked exactly; raises `RequestError` naming the first bad one."""
    if not isinstance(request, dict):
        raise RequestError(f"a request must be a dict, got {_describe(request)}")
    unknown = sorted(str(k)[:40] for k in set(request) - REQUEST_KEYS)
    if unknown:
        raise RequestError(f"unknown request fields {unknown} (known: {sorted(REQUEST_KEYS)})")
    policy = request.get("policy", "base")
    if not isinstance(policy, str):
        raise RequestError(f"'policy' must be a string ('base' or '<policy>@v<N>'), got {_describe(policy)}")
    try:
        ref = PolicyRef.parse(policy)
    except UnknownPolicyRef:
        ref = None
    if ref is None or not ref.is_zoo:  # a shipped policy's entry is verified where it is served
        model_ref(policy)  # InvalidAdapterName (an AdapterError) for anything but base / <policy>@v<N>

    max_tokens = request.get("max_tokens", DEFAULT_MAX_TOKENS)
    if not _is_int(max_tokens) or not 1 <= max_tokens <= limits.max_model_len:
        raise RequestError(
            f"'max_tokens' must be an int in [1, {limits.max_model_len}] (the context length), "
            f"got {_describe(max_tokens)}"
        )
    temperature = request.get("temperature", DEFAULT_TEMPERATURE)
    if (
        not isinstance(temperature, int | float)
        or isinstance(temperature, bool)
        or not math.isfinite(temperature)
        or not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE)
    ):
        raise RequestError(
            f"'temperature' must be 0 (greedy) or a finite number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], "
            f"got {_describe(temperature)}"
        )
    prompt = _validate_prompt(request.get("prompt"), limits)

    legal_raw = request.get("legal")
    legal = validate_legal(legal_raw) if legal_raw is not None else None
    reasoning = request.get("reasoning_max_tokens")
    if reasoning is not None:
        if legal is None:
            raise RequestError("'reasoning_max_tokens' only applies to constrained requests (with 'legal')")
        if not _is_int(reasoning) or not 0 <= reasoning <= limits.max_model_len:
            raise RequestError(
                f"'reasoning_max_tokens' must be an int in [0, {limits.max_model_len}] or null, "
                f"got {_describe(reasoning)}"
            )
    request_id = request.get("request_id")
    if request_id is not None:
        if (
            not isinstance(request_id, str)
            or not 1 <= len(request_id) <= MAX_REQUEST_ID
            or not request_id.isprintable()
        ):
            raise RequestError(
                f"'request_id' must be 1-{MAX_REQUEST_ID} printable characters, got {_describe(request_id)}"
            )
        _check_text(request_id, "'request_id'")
    sample_seed = request.get("sample_seed")
    if sample_seed is not None:
        if legal is None:
            raise RequestError("'sample_seed' only applies to constrained requests (with 'legal')")
        if not _is_int(sample_seed) or not 0 <= sample_seed < 2**63:
            raise RequestError(f"'sample_seed' must be an int in [0, 2**63) or null, got {_describe(sample_seed)}")
    return ValidRequest(
        policy=policy,
        prompt=prompt,
        legal=legal,
        temperature=float(temperature),
        max_tokens=max_tokens,
        reasoning_max_tokens=reasoning,
        request_id=request_id,
        sample_seed=sample_seed,
    )


def _validate_prompt(prompt: Any, limits: EngineLimits) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("'prompt' must be a non-empty string or list of token ids, got an empty string")
        # A token is at least one character: a longer string cannot fit, so it is not even tokenized.
        if len(prompt) > 64 * limits.max_model_len:
            raise RequestError(
                f"'prompt' has {len(prompt)} characters, far beyond the context of {limits.max_model_len} tokens"
            )
        _check_text(prompt, "'prompt'")
        return prompt
    if isinstance(prompt, list | tuple):
        if not prompt:
            raise RequestError("'prompt' must be a non-empty string or list of token ids, got an empty list")
        check_prompt_length(len(prompt), limits)
        for i, token in enumerate(prompt):
            if not _is_int(token) or not 0 <= token < limits.vocab_size:
                raise RequestError(
                    f"'prompt' token {i} must be an int id in [0, {limits.vocab_size}), got {_describe(token)}"
                )
        return tuple(prompt)
    raise RequestError(f"'prompt' must be a non-empty string or list of token ids, got {_describe(prompt)}")


def check_prompt_length(n_tokens: int, limits: EngineLimits) -> None:
    """A prompt must leave room for at least one generated token in the context."""
    if n_tokens >= limits.max_model_len:
        raise RequestError(
            f"'prompt' is {n_tokens} tokens; the context holds {limits.max_model_len} (prompt + at least 1 generated)"
        )


def validate_legal(data: Any) -> PowerOrders:
    """`PowerOrders.to_dict()` output checked for consistency: exact types, real powers and phases, every
    order a well-formed order of its own location for this phase kind, and something to order."""
    if not isinstance(data, Mapping):
        raise RequestError(f"'legal' must be PowerOrders.to_dict() (a dict), got {_describe(data)}")
    if set(data) != _LEGAL_KEYS:
        raise RequestError(f"'legal' must have exactly the keys {sorted(_LEGAL_KEYS)}, got {sorted(map(str, data))}")
    power, phase, kind_raw, n_required, by_loc = (data[k] for k in ("power", "phase", "kind", "n_required", "by_loc"))
    if power not in POWERS:
        raise RequestError(f"'legal.power' must be one of {sorted(POWERS)}, got {_describe(power)}")
    if not isinstance(phase, str) or not _PHASE_RE.fullmatch(phase):
        raise RequestError(f"'legal.phase' must be a phase name like 'S1901M', got {_describe(phase)}")
    try:
        kind = PhaseKind(kind_raw) if isinstance(kind_raw, str) else None
    except ValueError:
        kind = None
    if kind is None:
        raise RequestError(f"'legal.kind' must be one of {[k.value for k in PhaseKind]}, got {_describe(kind_raw)}")
    if kind is PhaseKind.NONE:
        raise RequestError(f"nothing to order: {power} has kind 'none' in {phase}; send no request for it")
    if not isinstance(by_loc, Mapping) or not by_loc:
        raise RequestError(
            f"nothing to order: 'legal.by_loc' must map locations to legal orders, got {_describe(by_loc)}"
        )
    if len(by_loc) > MAX_LOCATIONS:
        raise RequestError(f"'legal.by_loc' has {len(by_loc)} locations; a power has at most {MAX_LOCATIONS}")
    expected_phase = {"M": (PhaseKind.MOVEMENT,), "R": (PhaseKind.RETREAT,), "A": (PhaseKind.BUILD, PhaseKind.DISBAND)}
    if kind not in expected_phase[phase[-1]]:
        raise RequestError(f"'legal.kind' {kind.value!r} cannot occur in phase {phase}")
    pattern = _ORDER_RE[kind]
    clean: dict[str, tuple[str, ...]] = {}
    for loc, orders in by_loc.items():
        if not isinstance(loc, str) or not _LOC_RE.fullmatch(loc):
            raise RequestError(f"'legal.by_loc' key {_describe(loc)} is not a location like 'PAR' or 'STP/SC'")
        if not isinstance(orders, list | tuple) or not orders or len(orders) > MAX_ORDERS_PER_LOCATION:
            raise RequestError(
                f"'legal.by_loc[{loc}]' must be a list of 1-{MAX_ORDERS_PER_LOCATION} orders, got {_describe(orders)}"
            )
        if not all(isinstance(o, str) for o in orders) or len(set(orders)) != len(orders):
            raise RequestError(f"'legal.by_loc[{loc}]' must hold distinct order strings")
        for order in orders:
            match = pattern.fullmatch(order) if len(order) <= MAX_ORDER_CHARS else None
            if match is None:
                raise RequestError(
                    f"'legal.by_loc[{loc}]' holds {order[:80]!r}, not a {kind.value} order "
                    "(e.g. 'A PAR - BUR', 'F BRE H', 'A MAR S A PAR - BUR', 'A PAR R PIC', 'A PAR B', 'F BRE D')"
                )
            if match[1][:3] != loc[:3]:
                raise RequestError(
                    f"'legal.by_loc[{loc}]' holds {order!r}, an order for a unit in {match[1]}, not {loc}"
                )
        clean[loc] = tuple(orders)
    if not _is_int(n_required):
        raise RequestError(f"'legal.n_required' must be an int, got {_describe(n_required)}")
    if kind in (PhaseKind.MOVEMENT, PhaseKind.RETREAT):
        ok, rule = n_required == len(clean), f"= the number of locations ({len(clean)})"
    else:
        ok, rule = 1 <= n_required <= len(clean), f"in [1, {len(clean)}] (the number of locations)"
    if not ok:
        raise RequestError(f"'legal.n_required' must be {rule} for a {kind.value} phase, got {n_required}")
    return PowerOrders(power=power, phase=phase, kind=kind, by_loc=clean, n_required=n_required)
