"""The gateway's HTTP bodies as declared types (msgspec Structs), written once: what each API family's
requests may hold and the error shapes it answers. The parsers validate a request against its type
(`validate`), and openapi.py builds `/openapi.json` from the same types (`schemas`).

A request is read by orjson first, as the client sent it: that dict is what the trace records and
(for chat and completions) what goes to vLLM with the fields the gateway does not check. `validate`
then checks it against the family's type in one C pass (msgspec.convert, strict: no "5" for 5, no true
for 1) and returns the typed view the translation reads. A validation error is the family's 400,
naming the field as a dotted path (`messages.0.content.1.tool_use_id`) by these rules:
  - a missing field names itself; a missing tag (`type`, `role`) names the object, which then is
    no kind the gateway knows;
  - an unknown field names itself, as `unsupported_parameter`, and so does an unknown tag value (a
    kind of block, message or tool choice the gateway does not translate);
  - a value outside a one-value tag (a Literal `type`) names the object: it is not of that kind;
  - anything else names the field, as `invalid_value`.
Checks a type cannot state (a falsy flag, one prompt per call) live in the Struct's `__post_init__`,
their schema beside them in `Meta(extra_json_schema=...)`; `refused` names a field of the object.

Fields typed `Any` are read only when they have the expected type, or forwarded to vLLM as sent; an
`Ignored` field is accepted with no effect here (Trace.adjustments lists it).

Who may call: the family parsers (capture.py, messages.py, responses.py, gemini.py), the rollout
API's (rollouts.py, sessions.py) and openapi.py. No I/O.
"""

from __future__ import annotations

import re
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import msgspec
from msgspec import Meta, Struct

# Bounds the gateway holds every API's requests to itself, so that no such request reaches vLLM or
# the trace: an output limit above any served context (one that only exceeds this model's context is
# lowered to it, limits.py), and choices per call (OpenAI's own bound on `n`; each choice is recorded).
MAX_OUTPUT_TOKENS = 1 << 24
MAX_CHOICES = 128

# --- shared field types ------------------------------------------------------------------------------

OutputLimit = Annotated[
    int,
    Meta(
        ge=1,
        le=MAX_OUTPUT_TOKENS,
        description="an output limit above the served context is lowered to it (docs/gateway.md, Output limits)",
    ),
]
Choices = Annotated[int, Meta(ge=1, le=MAX_CHOICES, description="choices per call; each is recorded")]
NonEmpty = Annotated[str, Meta(min_length=1)]
Number = int | float  # kept as sent: 1 stays 1, not 1.0
MODEL_DESCRIPTION = "the served model (any other: 404 model_not_found)"  # openapi.py names it there
ModelName = Annotated[Any, Meta(description=MODEL_DESCRIPTION)]
Forwarded = Annotated[Any, Meta(description="forwarded to vLLM as sent (vLLM's own 400 names a bad value)")]
Loose = Annotated[Any, Meta(description="any value: read only when it has the expected type")]
Ignored = Annotated[Any, Meta(description="accepted, with no effect here (recorded as ignored)")]
# The values a parser's `if value:` takes for absent.
_FALSY: list[Any] = [None, False, 0, "", [], {}]


BeamSearch = Annotated[
    Any,
    Meta(
        extra_json_schema={
            "enum": _FALSY,
            "description": "beam search reports no sampler logprobs: true is refused",
        }
    ),
]
Echo = Annotated[
    Any, Meta(extra_json_schema={"enum": _FALSY, "description": "echoed prompt tokens are refused"})
]


# --- errors ----------------------------------------------------------------------------------------


class OpenAIErrorDetail(Struct, forbid_unknown_fields=True):
    message: NonEmpty
    type: str
    param: str | None
    code: str | None


class OpenAIError(Struct, forbid_unknown_fields=True):
    """OpenAI's error shape, answered on every route but Anthropic's and Google's."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(Struct, forbid_unknown_fields=True):
    type: str
    message: NonEmpty


class AnthropicError(Struct, forbid_unknown_fields=True):
    """Anthropic's error shape, answered on /v1/messages..."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class GoogleErrorDetail(Struct, forbid_unknown_fields=True):
    code: int
    message: NonEmpty
    status: str


class GoogleError(Struct, forbid_unknown_fields=True):
    """Google's error shape, answered on the Gemini routes."""

    error: GoogleErrorDetail


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape (OpenAIError); app.py answers it in the
    route's family's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = msgspec.to_builtins(OpenAIError(OpenAIErrorDetail(message, type, param, code)))
    return body


def unsupported(names: list[str], why: str = "") -> ApiError:
    """400 naming the request fields this gateway does not support."""
    names = sorted(names)
    listed = ", ".join(f"'{n}'" for n in names)
    noun = "parameter" if len(names) == 1 else "parameters"
    return ApiError(
        400,
        f"Unsupported {noun} {listed}" + (f": {why}" if why else ""),
        param=names[0],
        code="unsupported_parameter",
    )


def invalid(param: str, message: str) -> ApiError:
    """400 for a request field of the wrong shape, naming it."""
    return ApiError(400, f"'{param}' {message}", param=param, code="invalid_value")


# --- validation ------------------------------------------------------------------------------------

_TAGS = frozenset({"type", "role"})
_MESSAGE = re.compile(r"(?P<what>.*?)(?: - at `\$(?P<path>.*)`)?", re.S)
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_FIELD = re.compile(r"(?P<unsupported>unsupported )?field `(?P<name>[^`]+)`: (?P<why>.*)", re.S)
_MISSING = re.compile(r"Object missing required field `(?P<name>[^`]+)`")
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<name>[^`]+)`")


def refused(name: str, why: str, not_supported: bool = False) -> ValueError:
    """For a `__post_init__`: field `name` of this object (a dotted path below it) is refused, `why`:
    as a bad value, or (`not_supported`) as something this gateway does not do."""
    return ValueError(f"{'unsupported ' if not_supported else ''}field `{name}`: {why}")


T = TypeVar("T")


def validate(
    body: dict[str, Any], kind: type[T], codes: dict[str, str] | None = None, status: int = 400
) -> T:
    """`body` (parsed JSON) as a `kind`, or the 4xx naming what is wrong (400; the rollout API's 422).
    `codes`: an error code per top-level field, where a route answers with its own."""
    try:
        return msgspec.convert(body, kind, strict=True)
    except msgspec.ValidationError as exc:
        err = _api_error(str(exc), codes or {})
        err.status = status
        raise err from None


def _api_error(text: str, codes: dict[str, str]) -> ApiError:
    m = _MESSAGE.fullmatch(text)
    what, steps = (m["what"], _steps(m["path"] or "")) if m else (text, [])
    if f := _FIELD.fullmatch(what):
        where = ".".join([*steps, f["name"]])
        return unsupported([where], f["why"]) if f["unsupported"] else invalid(where, f["why"])
    if f := _UNKNOWN.fullmatch(what):
        return unsupported([".".join([*steps, f["name"]])])
    if f := _MISSING.fullmatch(what):
        if f["name"] in _TAGS and steps:
            return invalid(".".join(steps), f"must be an object with a '{f['name']}'")
        steps = [*steps, f["name"]]
        what = "is required"
    elif what.startswith("Invalid enum value") and len(steps) > 1 and steps[-1] == "type":
        kind = steps.pop()  # a one-value tag: the object is of another kind than the one allowed here
        what = f"is of a kind not allowed here ({kind} {what[len('Invalid enum value ') :]})"
    elif what.startswith("Invalid value") and steps and steps[-1] in _TAGS:
        return unsupported([".".join(steps)], what[0].lower() + what[1:])
    param = ".".join(steps) or "body"
    err = invalid(param, what[0].lower() + what[1:])
    if steps and steps[0] in codes:
        err.code = codes[steps[0]]
    return err


def _steps(path: str) -> list[str]:
    return [name or index for name, index in _STEP.findall(path)]


def field_names(kind: type[Struct]) -> frozenset[str]:
    """The JSON names of a body's fields."""
    return frozenset(f.encode_name for f in msgspec.structs.fields(kind))


def ignored_fields(kind: type[Struct]) -> frozenset[str]:
    """The fields of a body declared `Ignored`."""
    return frozenset(f.encode_name for f in msgspec.structs.fields(kind) if f.type == Ignored)


def schemas(kinds: list[Any]) -> tuple[tuple[dict[str, Any], ...], dict[str, Any]]:
    """JSON Schemas of `kinds` (refs into OpenAPI's components) and the components they use, with
    what a Struct's config cannot say: a tag that may be left out (DEFAULT_TAGS), unknown fields
    allowed as null (NULL_EXTRAS)."""
    refs, components = msgspec.json.schema_components(kinds, ref_template="#/components/schemas/{name}")
    for kind in DEFAULT_TAGS:
        if (schema := components.get(kind.__name__)) is not None:
            tag = kind.__struct_config__.tag_field
            schema["required"] = [r for r in schema["required"] if r != tag]
    for kind in NULL_EXTRAS:
        if (schema := components.get(kind.__name__)) is not None:
            schema["additionalProperties"] = {"type": "null"}
    return refs, components


# --- OpenAI chat completions and completions ---------------------------------------------------------


class ChatCompletionRequest(Struct, kw_only=True):
    """OpenAI chat completions (capture.parse_chat_request): the gateway checks what it relies on and
    what it bounds; every other field goes to vLLM as sent."""

    messages: Annotated[list[Any], Meta(min_length=1, description="forwarded to vLLM as sent")]
    model: ModelName = None
    stream: bool | None = None
    max_tokens: OutputLimit | None = None
    max_completion_tokens: OutputLimit | None = None
    n: Choices | None = None
    logprobs: Forwarded = None
    return_token_ids: Forwarded = None
    use_beam_search: BeamSearch = None
    temperature: Forwarded = None
    tools: Forwarded = None

    def __post_init__(self) -> None:
        if self.use_beam_search:
            raise unsupported(["use_beam_search"], "beam search does not report sampler logprobs")


_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_PROMPT = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        _IDS,
        {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [{"type": "string"}, _IDS]}},
    ],
    "description": "text or token ids; a batch of one at most (each call records one prompt)",
}


def is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value)
    )


class CompletionRequest(Struct, kw_only=True):
    """OpenAI completions (capture.parse_completion_request): one prompt per call, since a trace
    records one prompt. `logprobs` is the number of top logprobs, as in OpenAI's legacy API."""

    prompt: Annotated[Any, Meta(extra_json_schema=_PROMPT)]
    model: ModelName = None
    stream: bool | None = None
    max_tokens: OutputLimit | None = None
    n: Choices | None = None
    best_of: Choices | None = None
    logprobs: Annotated[int, Meta(ge=0, description="the number of top logprobs")] | None = None
    return_token_ids: Forwarded = None
    echo: Echo = None
    use_beam_search: BeamSearch = None
    prompt_embeds: Annotated[
        Any,
        Meta(extra_json_schema={"type": "null", "description": "a prompt as embeddings has no token ids"}),
    ] = None
    temperature: Forwarded = None

    def __post_init__(self) -> None:
        prompt = self.prompt
        if (
            isinstance(prompt, list)
            and len(prompt) == 1
            and (isinstance(prompt[0], str) or is_ids(prompt[0]))
        ):
            pass  # a batch of one
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
            raise unsupported(
                ["prompt"],
                f"a batch of {len(prompt)} prompts; send one prompt per request "
                "(each call is recorded with its own prompt token ids)",
            )
        elif not (isinstance(prompt, str) and prompt) and not is_ids(prompt):
            raise invalid(
                "prompt", "must be a non-empty string or a non-empty array of token ids (ints >= 0)"
            )
        if self.echo:
            raise unsupported(["echo"], "echoed prompt tokens would be mixed into the sampled ones")
        if self.use_beam_search:
            raise unsupported(["use_beam_search"], "beam search does not report sampler logprobs")
        if self.prompt_embeds is not None:
            raise unsupported(["prompt_embeds"], "a prompt given as embeddings has no token ids to record")


# --- Anthropic Messages ---------------------------------------------------------------------------
# Blocks carry more fields than these (cache_control, citations, ...): read none, refused none.


class AnthropicText(Struct, tag_field="type", tag="text"):
    text: str


class AnthropicSystemText(Struct):
    """A text block where only text may be (a system prompt)."""

    type: Literal["text"]
    text: str


class AnthropicBase64Source(Struct, tag_field="type", tag="base64"):
    media_type: str
    data: str


class AnthropicUrlSource(Struct, tag_field="type", tag="url"):
    url: str


class AnthropicImage(Struct, tag_field="type", tag="image"):
    source: AnthropicBase64Source | AnthropicUrlSource


class AnthropicToolResult(Struct, tag_field="type", tag="tool_result", kw_only=True):
    tool_use_id: NonEmpty
    content: str | list[AnthropicText | AnthropicImage] | None = None
    is_error: Loose = None


class AnthropicToolUse(Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: NonEmpty
    name: NonEmpty
    input: dict[str, Any] = {}


class AnthropicThinking(Struct, tag_field="type", tag="thinking"):
    """Anthropic's own reasoning record of an earlier turn (signed): dropped, and counted."""


class AnthropicRedactedThinking(Struct, tag_field="type", tag="redacted_thinking"):
    """The same, encrypted: dropped, and counted."""


SystemPrompt = str | list[AnthropicSystemText]


class AnthropicUserMessage(Struct, tag_field="role", tag="user"):
    content: str | list[AnthropicText | AnthropicImage | AnthropicToolResult]


class AnthropicAssistantMessage(Struct, tag_field="role", tag="assistant"):
    content: str | list[AnthropicText | AnthropicToolUse | AnthropicThinking | AnthropicRedactedThinking]


class AnthropicSystemMessage(Struct, tag_field="role", tag="system"):
    """A system entry in place, mid-conversation (Claude Code's agent lists and reminders)."""

    content: SystemPrompt | None = None


_SERVER_TOOL = "a tool Anthropic's service runs (web_search_*, bash_*, ...): dropped, and recorded"


class AnthropicTool(Struct, kw_only=True):
    """A custom tool (no type, or "custom"), or a server tool (any other type): dropped, and recorded."""

    type: str | None = None
    name: Annotated[Any, Meta(description="a non-empty string (a custom tool's is required)")] = None
    description: Loose = None
    input_schema: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET
    strict: Loose = None

    @property
    def custom(self) -> bool:
        return not self.type or self.type == "custom"

    def __post_init__(self) -> None:
        if (not self.type or self.type == "custom") and not (isinstance(self.name, str) and self.name):
            raise refused("name", "must be a non-empty string")


class AnthropicToolChoiceAuto(Struct, tag_field="type", tag="auto"):
    disable_parallel_tool_use: Loose = None


class AnthropicToolChoiceAny(Struct, tag_field="type", tag="any"):
    disable_parallel_tool_use: Loose = None


class AnthropicToolChoiceNone(Struct, tag_field="type", tag="none"):
    disable_parallel_tool_use: Loose = None


class AnthropicToolChoiceTool(Struct, tag_field="type", tag="tool", kw_only=True):
    name: NonEmpty
    disable_parallel_tool_use: Loose = None


AnthropicToolChoice = (
    AnthropicToolChoiceAuto | AnthropicToolChoiceAny | AnthropicToolChoiceNone | AnthropicToolChoiceTool
)


class AnthropicThinkingConfig(Struct):
    """enabled and adaptive switch the template's reasoning on, disabled off; another type is recorded
    as ignored (Claude Code sends whatever its own release knows)."""

    type: Loose = None
    budget_tokens: Loose = None


class AnthropicJsonFormat(Struct):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class AnthropicOutputConfig(Struct, forbid_unknown_fields=True):
    format: AnthropicJsonFormat | None = None
    effort: Ignored = None


class MessagesBody(Struct, kw_only=True, forbid_unknown_fields=True):
    """Anthropic Messages (messages.parse_messages_request): any other field is refused (400), since
    an unknown field may change generation."""

    model: ModelName = None
    messages: Annotated[
        list[AnthropicUserMessage | AnthropicAssistantMessage | AnthropicSystemMessage], Meta(min_length=1)
    ]
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_OUTPUT_TOKENS)]
    system: SystemPrompt | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: int | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinkingConfig | None = None
    output_config: AnthropicOutputConfig | None = None
    # Routing, caching, attribution and context-editing hints of Anthropic's service.
    metadata: Ignored = None
    service_tier: Ignored = None
    cache_control: Ignored = None
    inference_geo: Ignored = None
    speed: Ignored = None
    diagnostics: Ignored = None
    user_profile_id: Ignored = None
    workspace_id: Ignored = None
    context_management: Ignored = None


class MessagesCountTokensBody(MessagesBody, kw_only=True, forbid_unknown_fields=True):
    """`/v1/messages/count_tokens`: not a call, so no output limit is needed and a stream flag is
    dropped, whatever it holds."""

    max_tokens: Annotated[int, Meta(ge=1, le=MAX_OUTPUT_TOKENS)] = 1
    stream: Loose = None


# --- OpenAI Responses -----------------------------------------------------------------------------


class ResponsesInputText(Struct, tag_field="type", tag="input_text"):
    text: str


class ResponsesOutputText(Struct, tag_field="type", tag="output_text"):
    text: str


class ResponsesText(Struct, tag_field="type", tag="text"):
    text: str


class ResponsesRefusal(Struct, tag_field="type", tag="refusal"):
    refusal: Annotated[Any, Meta(description="kept as text when a string")] = None


class ResponsesInputImage(Struct, tag_field="type", tag="input_image", kw_only=True):
    image_url: Annotated[Any, Meta(extra_json_schema={"type": "string", "minLength": 1})] = msgspec.UNSET
    detail: Annotated[Any, Meta(description="passed on when a string; anything else is left out")] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.image_url, str) and self.image_url):
            raise refused("file_id", "images must be given by 'image_url' (no file storage here)", True)


ResponsesPart = (
    ResponsesInputText | ResponsesOutputText | ResponsesText | ResponsesRefusal | ResponsesInputImage
)
ResponsesContent = str | list[ResponsesPart]


class ResponsesMessage(Struct, tag_field="type", tag="message"):
    """A message item; its `type` may be left out (OpenAI's own default)."""

    role: Literal["user", "assistant", "system", "developer"]
    content: ResponsesContent


class ResponsesFunctionCall(Struct, tag_field="type", tag="function_call", kw_only=True):
    call_id: NonEmpty
    name: NonEmpty
    arguments: Annotated[str, Meta(description="JSON")]
    namespace: Loose = None


class ResponsesCustomToolCall(Struct, tag_field="type", tag="custom_tool_call"):
    call_id: NonEmpty
    name: NonEmpty
    input: str


class ResponsesFunctionCallOutput(Struct, tag_field="type", tag="function_call_output"):
    call_id: NonEmpty
    output: ResponsesContent


class ResponsesCustomToolCallOutput(Struct, tag_field="type", tag="custom_tool_call_output"):
    call_id: NonEmpty
    output: ResponsesContent


# History items that are the record of something only OpenAI's service ran or can read: reasoning (its
# encrypted_content), hosted tool calls, remote compaction. vLLM gets the conversation without them.
RESPONSES_DROPPED_ITEMS = (
    "reasoning",
    "compaction",
    "compaction_summary",
    "web_search_call",
    "file_search_call",
    "image_generation_call",
    "code_interpreter_call",
    "computer_call",
    "computer_call_output",
    "local_shell_call",
    "local_shell_call_output",
    "mcp_call",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "tool_search_call",
    "tool_search_output",
)
_DROPPED_DOC = "the record of something only OpenAI's service ran: dropped, and counted"
DROPPED_ITEM_TYPES: tuple[type[Struct], ...] = tuple(
    msgspec.defstruct(
        "Dropped" + "".join(w.title() for w in kind.split("_")),
        [],
        tag_field="type",
        tag=kind,
        namespace={"__doc__": _DROPPED_DOC},
    )
    for kind in RESPONSES_DROPPED_ITEMS
)
if TYPE_CHECKING:  # the dropped items' types are made at run time
    ResponsesItem = (
        ResponsesMessage
        | ResponsesFunctionCall
        | ResponsesCustomToolCall
        | ResponsesFunctionCallOutput
        | ResponsesCustomToolCallOutput
        | Struct
    )
else:
    ResponsesItem = Union[  # noqa: UP007 (a union built from a tuple)
        (
            ResponsesMessage,
            ResponsesFunctionCall,
            ResponsesCustomToolCall,
            ResponsesFunctionCallOutput,
            ResponsesCustomToolCallOutput,
            *DROPPED_ITEM_TYPES,
        )
    ]
# Tagged types whose tag a client may leave out, and the tag it then means.
DEFAULT_TAGS: dict[type[Struct], str] = {ResponsesMessage: "message"}


def with_default_tags(items: Any, tag_field: str = "type", tag: str = "message") -> Any:
    """`items` with `tag_field` filled in where an object left it out (shallow copies: the body as sent
    stays as sent)."""
    if not isinstance(items, list):
        return items
    return [{**i, tag_field: tag} if isinstance(i, dict) and tag_field not in i else i for i in items]


class ResponsesTool(Struct, kw_only=True):
    """A function or custom (freeform) tool, a namespace of them (Codex's multi-agent and MCP tools),
    or a tool only OpenAI's service runs (any other type): dropped, and recorded."""

    type: Loose = None
    name: Annotated[Any, Meta(description="a non-empty string (required but for dropped tools)")] = None
    parameters: Forwarded = None
    description: Loose = None
    strict: Loose = None
    format: Annotated[
        Any, Meta(description="a custom tool's grammar: {type: grammar, syntax, definition}")
    ] = None
    tools: list[ResponsesTool] | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if self.type in ("function", "custom", "namespace") and not (
            isinstance(self.name, str) and self.name
        ):
            raise refused("name", "must be a non-empty string")
        if self.type == "namespace" and self.tools is msgspec.UNSET:
            raise refused("tools", "must be an array")


class ResponsesToolChoiceFunction(Struct, tag_field="type", tag="function"):
    name: NonEmpty


class ResponsesToolChoiceCustom(Struct, tag_field="type", tag="custom"):
    name: NonEmpty


class ResponsesTextFormat(Struct, tag_field="type", tag="text"):
    pass


class ResponsesJsonObjectFormat(Struct, tag_field="type", tag="json_object"):
    pass


class ResponsesJsonSchemaFormat(Struct, tag_field="type", tag="json_schema", kw_only=True):
    schema: dict[str, Any]
    name: Annotated[Any, Meta(description="default: response")] = None
    strict: Forwarded = None
    description: Forwarded = None


class ResponsesTextConfig(Struct):
    format: ResponsesTextFormat | ResponsesJsonObjectFormat | ResponsesJsonSchemaFormat | None = None


_NO_STATE = "this gateway stores no responses or conversations; send the whole conversation in 'input'"
NotStored = Annotated[
    Any, Meta(extra_json_schema={"type": "null", "description": "nothing is stored: refused unless null"})
]
NoBackground = Annotated[Any, Meta(extra_json_schema={"enum": _FALSY, "description": "no background mode"})]


class ResponsesBody(Struct, kw_only=True):
    """OpenAI Responses (responses.parse_responses_request): any other field is refused unless null
    (`NULL_EXTRAS`)."""

    model: ModelName = None
    input: str | Annotated[list[ResponsesItem], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: OutputLimit | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stream: bool | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: (
        Literal["auto", "none", "required"] | ResponsesToolChoiceFunction | ResponsesToolChoiceCustom | None
    ) = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: NotStored = None
    conversation: NotStored = None
    background: NoBackground = None
    # Bookkeeping this gateway does not keep (it stores nothing) and hints of OpenAI's service (caching,
    # attribution, Codex's session and turn ids).
    store: Ignored = None
    metadata: Ignored = None
    user: Ignored = None
    truncation: Ignored = None
    service_tier: Ignored = None
    prompt_cache_key: Ignored = None
    safety_identifier: Ignored = None
    stream_options: Ignored = None
    prompt_cache_retention: Ignored = None
    client_metadata: Ignored = None

    def __post_init__(self) -> None:
        if self.previous_response_id is not None:
            raise unsupported(["previous_response_id"], _NO_STATE)
        if self.conversation is not None:
            raise unsupported(["conversation"], _NO_STATE)
        if self.background:
            raise unsupported(["background"], "responses are answered in the request (no background mode)")


# --- Google's Gemini API --------------------------------------------------------------------------
# Field names are camelCase, as Google's JSON writes them; its API also reads the proto's snake_case
# names (the google-genai Python SDK sends those inside parts, tools and configs): `camel_keys`
# rewrites them before validation, in the objects these types declare (not inside schemas or args).

GEMINI_PAYLOADS = ("text", "inlineData", "fileData", "functionCall", "functionResponse")


class GeminiBlob(Struct, kw_only=True):
    """inlineData: an image as base64 (only images can be forwarded to the model)."""

    mimeType: Annotated[Any, Meta(extra_json_schema={"type": "string", "pattern": "^image/"})] = msgspec.UNSET
    data: Annotated[Any, Meta(extra_json_schema={"type": "string", "minLength": 1})] = msgspec.UNSET


class GeminiFileData(Struct, kw_only=True):
    """fileData: an image by http(s) or data: URL (no file storage here)."""

    mimeType: Annotated[Any, Meta(extra_json_schema={"type": "string", "pattern": "^image/"})] = msgspec.UNSET
    fileUri: Annotated[Any, Meta(extra_json_schema={"type": "string"})] = msgspec.UNSET


class GeminiFunctionCall(Struct, kw_only=True):
    name: NonEmpty
    args: dict[str, Any] | None = None
    id: NonEmpty | None = None


class GeminiFunctionResponse(Struct, kw_only=True):
    name: NonEmpty
    response: dict[str, Any] = {}
    id: NonEmpty | None = None
    parts: Annotated[Any, Meta(description="refused: send images as parts next to the functionResponse")] = (
        None
    )

    def __post_init__(self) -> None:
        if self.parts:
            raise refused("parts", "send images as parts next to the functionResponse", True)


class GeminiPart(Struct, kw_only=True, forbid_unknown_fields=True):
    """Google's Part is a oneof: exactly one payload, with bookkeeping of Google's model (or of
    Gemini CLI) beside it."""

    text: str | None = None
    inlineData: GeminiBlob | None = None
    fileData: GeminiFileData | None = None
    functionCall: GeminiFunctionCall | None = None
    functionResponse: GeminiFunctionResponse | None = None
    thought: Loose = None
    thoughtSignature: Ignored = None
    partMetadata: Ignored = None
    mediaResolution: Ignored = None
    callIndex: Ignored = None

    @property
    def payload(self) -> str:
        return next(k for k in GEMINI_PAYLOADS if getattr(self, k) is not None)

    def __post_init__(self) -> None:
        held = (
            (self.text is not None)
            + (self.inlineData is not None)
            + (self.fileData is not None)
            + (self.functionCall is not None)
            + (self.functionResponse is not None)
        )
        if held != 1:
            raise ValueError("must hold exactly one of " + ", ".join(GEMINI_PAYLOADS))
        if self.inlineData is not None or self.fileData is not None:
            self._check_image()

    def _check_image(self) -> None:
        blob = self.inlineData or self.fileData
        if blob is not None:
            kind = self.payload
            mime = None if blob.mimeType is msgspec.UNSET else blob.mimeType
            if not isinstance(mime, str) or not mime.startswith("image/"):
                raise refused(
                    f"{kind}.mimeType", f"'{mime}' (only images can be forwarded to the model)", True
                )
            if isinstance(blob, GeminiBlob) and not (isinstance(blob.data, str) and blob.data):
                raise refused("inlineData.data", "must be a non-empty base64 string")
            uri = getattr(blob, "fileUri", None)
            if isinstance(blob, GeminiFileData) and not (
                isinstance(uri, str) and uri.startswith(("http://", "https://", "data:"))
            ):
                raise refused("fileData.fileUri", "only http(s) or data: URLs (no file storage here)", True)


_ROLES = ("user", "model", "function")  # "function": the older role of functionResponse turns


class GeminiContent(Struct, kw_only=True):
    """A turn; Google takes one without a role as the user's."""

    parts: list[GeminiPart]
    role: Annotated[Any, Meta(extra_json_schema={"enum": [*_ROLES, *_FALSY]})] = None

    def __post_init__(self) -> None:
        if self.role and self.role not in _ROLES:
            raise refused("role", "must be 'user' or 'model'")


class GeminiSystemInstruction(Struct, kw_only=True):
    parts: list[GeminiPart]
    role: Loose = None


class GeminiFunctionDeclaration(Struct, kw_only=True):
    name: NonEmpty
    description: Loose = None
    parameters: Annotated[dict[str, Any], Meta(description="Google's OpenAPI-subset Schema")] | None = None
    parametersJsonSchema: dict[str, Any] | None = None


class GeminiTool(Struct, kw_only=True):
    """Function declarations; any other tool (googleSearch, codeExecution, urlContext, ...) is Google's
    to run: dropped, and recorded."""

    functionDeclarations: list[GeminiFunctionDeclaration] | None = None


_MODES = ("AUTO", "ANY", "NONE", "VALIDATED", "MODE_UNSPECIFIED")


class GeminiFunctionCallingConfig(Struct, kw_only=True):
    mode: Annotated[Any, Meta(extra_json_schema={"enum": [*_MODES, *_FALSY]})] = None
    allowedFunctionNames: list[str] | None = None

    def __post_init__(self) -> None:
        if self.mode and self.mode not in _MODES:
            raise refused("mode", "must be one of AUTO, ANY, NONE, VALIDATED")


class GeminiToolConfig(Struct, kw_only=True):
    functionCallingConfig: GeminiFunctionCallingConfig | None = None


class GeminiThinkingConfig(Struct, kw_only=True):
    thinkingBudget: int | None = None
    includeThoughts: bool | None = None
    thinkingLevel: Ignored = None


class GeminiGenerationConfig(Struct, kw_only=True):
    """Any other field is refused unless null (`NULL_EXTRAS`)."""

    temperature: Number | None = None
    topP: Number | None = None
    topK: int | None = None
    seed: int | None = None
    presencePenalty: Number | None = None
    frequencyPenalty: Number | None = None
    maxOutputTokens: OutputLimit | None = None
    candidateCount: Choices | None = None
    stopSequences: list[str] | None = None
    responseMimeType: Literal["text/plain", "application/json"] | None = None
    responseSchema: Annotated[dict[str, Any], Meta(description="Google's OpenAPI-subset Schema")] | None = (
        None
    )
    responseJsonSchema: dict[str, Any] | None = None
    thinkingConfig: GeminiThinkingConfig | None = None
    responseModalities: Annotated[
        Any,
        Meta(extra_json_schema={"anyOf": [{"type": "array", "items": {"const": "TEXT"}}, {"type": "null"}]}),
    ] = None
    # Hints about Google's own serving with nothing to do for a text model here.
    enableEnhancedCivicAnswers: Ignored = None
    mediaResolution: Ignored = None
    audioTimestamp: Ignored = None
    routingConfig: Ignored = None
    modelSelectionConfig: Ignored = None

    def __post_init__(self) -> None:
        modalities = self.responseModalities
        if modalities is not None and (
            not isinstance(modalities, list) or any(m != "TEXT" for m in modalities)
        ):
            raise refused("responseModalities", "the served model writes text only", True)


NO_CACHE = "no context cache here; send the whole conversation in 'contents'"


class GenerateContentBody(Struct, kw_only=True):
    """Google's GenerateContentRequest (gemini.parse_generate_request); the model and whether to stream
    are in the path. Any other field is refused unless null (`NULL_EXTRAS`)."""

    contents: Annotated[list[GeminiContent], Meta(min_length=1)]
    systemInstruction: str | GeminiSystemInstruction | None = None
    tools: list[GeminiTool] | None = None
    toolConfig: GeminiToolConfig | None = None
    generationConfig: GeminiGenerationConfig | None = None
    cachedContent: Annotated[
        Any,
        Meta(extra_json_schema={"type": "null", "description": "no context cache here: refused unless null"}),
    ] = None
    # Google-side policy, billing and storage knobs; `model` is in the path (a body may repeat it, as
    # countTokens' generateContentRequest does).
    safetySettings: Ignored = None
    labels: Ignored = None
    serviceTier: Ignored = None
    store: Ignored = None
    model: Ignored = None

    def __post_init__(self) -> None:
        if self.cachedContent is not None:
            raise unsupported(["cachedContent"], NO_CACHE)


class GeminiCountTokensBody(Struct, kw_only=True):
    """countTokens: contents, or a whole generateContentRequest."""

    contents: Annotated[list[GeminiContent], Meta(min_length=1)] | None = None
    generateContentRequest: GenerateContentBody | None = None

    def __post_init__(self) -> None:
        if self.generateContentRequest is not None and self.contents is not None:
            raise refused("contents", "must not be given with 'generateContentRequest'")
        if self.generateContentRequest is None and self.contents is None:
            raise refused("contents", "is required (or 'generateContentRequest')")


def camel(obj: dict[str, Any]) -> dict[str, Any]:
    """Field names as lowerCamelCase (a new dict if any changes; camelCase wins where both are given)."""
    if "_" not in "".join(obj):
        return obj
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if "_" in key:
            head, *rest = key.split("_")
            out[head + "".join(w[:1].upper() + w[1:] for w in rest)] = value
    for key, value in obj.items():
        if "_" not in key:
            out[key] = value
    return out


# A key with an underscore in JSON text: a string followed by a colon (no string value can be).
_SNAKE_KEY = re.compile(rb'"[^"\\]*_[^"\\]*"\s*:')


def snake_keys(raw: bytes) -> bool:
    """Whether the JSON text `raw` may hold a snake_case key (one with an escape in it: maybe), so
    that `camel_keys` has anything to do."""
    return b"\\" in raw or _SNAKE_KEY.search(raw) is not None


def _nested(kind: type) -> dict[str, tuple[type, bool]]:
    """The fields of a Struct that hold Structs: name -> (the Struct, whether a list of them)."""
    out: dict[str, tuple[type, bool]] = {}
    for f in msgspec.structs.fields(kind):
        for arm in _arms(f.type):
            many = get_origin(arm) is list
            for inner in _arms(get_args(arm)[0]) if many else [arm]:
                if isinstance(inner, type) and issubclass(inner, Struct):
                    out[f.encode_name] = (inner, many)
    return out


def _arms(tp: Any) -> list[Any]:
    """The members of a union (Annotated unwrapped), or the type itself."""
    if get_origin(tp) is Annotated:
        return _arms(get_args(tp)[0])
    if get_origin(tp) in (Union, UnionType):
        return [a for arm in get_args(tp) for a in _arms(arm)]
    return [tp]


_NESTED: dict[type, dict[str, tuple[type, bool]]] = {}


def camel_keys(value: Any, kind: type) -> Any:
    """`value` with the field names of every object `kind` declares (at any depth) camelCased; shared
    where nothing changes, so the body as sent stays as sent."""
    if not isinstance(value, dict):
        return value
    out = camel(value)
    nested = _NESTED.get(kind)
    if nested is None:
        nested = _NESTED[kind] = _nested(kind)
    for name, (inner, many) in nested.items():
        field = out.get(name)
        if field is None:
            continue
        if many and isinstance(field, list):
            new: Any = [camel_keys(x, inner) for x in field]
            changed = any(a is not b for a, b in zip(new, field, strict=True))
        else:
            new = camel_keys(field, inner)
            changed = new is not field
        if changed:
            out = dict(out) if out is value else out
            out[name] = new
    return out


# Bodies whose unknown fields are accepted when null (and refused otherwise, before validation).
NULL_EXTRAS: tuple[type[Struct], ...] = (
    ResponsesBody,
    GenerateContentBody,
    GeminiGenerationConfig,
    GeminiCountTokensBody,
)


# --- what the routes answer ---------------------------------------------------------------------------
# The agent-facing answers are vLLM's (chat, completions) or translated from them: these types say
# what every answer holds, not all it may hold.


class Completion(Struct):
    """A chat completion or a completion (vLLM's, relayed)."""

    id: str
    choices: list[Any]


class AnthropicMessage(Struct):
    id: str
    type: Literal["message"]
    content: list[Any]


class Response(Struct):
    """An OpenAI Responses answer."""

    id: str
    object: Literal["response"]
    output: list[Any]


class GenerateContentResponse(Struct):
    candidates: list[Any]


class InputTokens(Struct):
    input_tokens: int


class TotalTokens(Struct):
    totalTokens: int


class Model(Struct, kw_only=True):
    id: str
    object: Literal["model"]
    created: int | msgspec.UnsetType = msgspec.UNSET
    owned_by: str | msgspec.UnsetType = msgspec.UNSET


class ModelList(Struct):
    object: Literal["list"]
    data: list[Model]


class GoogleModel(Struct):
    name: str
    supportedGenerationMethods: list[str]


class GoogleModelList(Struct):
    models: list[GoogleModel]


class Health(Struct):
    status: Literal["ok"]


class Unhealthy(Struct):
    status: Literal["unavailable"]


# --- the rollout API (rollouts.py, sessions.py) --------------------------------------------------------

FP32_MAX = 3.4028234663852886e38
Reward = Annotated[float, Meta(ge=-FP32_MAX, le=FP32_MAX, description="a finite number in float32's range")]


class CreateRolloutRequest(Struct, kw_only=True):
    task_id: NonEmpty
    group_id: NonEmpty
    group_size: (
        Annotated[int, Meta(ge=1, description="default: the gateway's TETHER_GROUP_SIZE")] | msgspec.UnsetType
    ) = msgspec.UNSET
    metadata: (
        Annotated[dict[str, Any], Meta(description="kept with the rollout (attempt, max_attempts, eval...)")]
        | None
    ) = None


class RewardRequest(Struct):
    """A reward (NaN and Infinity literals are read, then refused as values, 422)."""

    reward: Reward


class SessionRewardRequest(Struct):
    call_id: NonEmpty
    reward: Reward


class FailRolloutRequest(Struct):
    """Optional: an empty body fails the rollout with no reason."""

    reason: str | msgspec.UnsetType = msgspec.UNSET


class Rollout(Struct, kw_only=True):
    rollout_id: str
    task_id: str | None
    group_id: str | None
    group_size: int
    status: Literal["running", "completed", "failed"]
    created_at: float | None | msgspec.UnsetType = msgspec.UNSET
    finished_at: float | None | msgspec.UnsetType = msgspec.UNSET
    reward: float | None | msgspec.UnsetType = msgspec.UNSET
    reason: str | None | msgspec.UnsetType = msgspec.UNSET
    metadata: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET
    calls: Annotated[int, Meta(ge=0)]
    replica: str | None | msgspec.UnsetType = msgspec.UNSET
    training: dict[str, Any]
    warning: str | None | msgspec.UnsetType = msgspec.UNSET


class NewRollout(Struct, kw_only=True):
    rollout_id: str
    api_key: str
    base_url: str
    rollout_base_url: str
    anthropic_base_url: str | msgspec.UnsetType = msgspec.UNSET
    rollout_anthropic_base_url: str | msgspec.UnsetType = msgspec.UNSET
    gemini_base_url: str | msgspec.UnsetType = msgspec.UNSET
    model: str


class CallReward(Struct):
    rollout_id: str
    call_id: str
    reward: float
    replaced: bool


# --- the run API (runs.py; docs/runs.md) ------------------------------------------------------------------

RunStatus = Literal["created", "running", "stopping", "stopped", "failed"]  # common.runs.RunStatus


class RunConfig(Struct, forbid_unknown_fields=True):
    """A run config's shape (docs/recipes.md): one mapping per service section, and the run keys. The
    settings inside a section are checked by `tether run create` (tether.runconfig), not here."""

    gateway: dict[str, Any] | None = None
    merger: dict[str, Any] | None = None
    trainer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    kube: dict[str, Any] | None = None
    inference: dict[str, Any] | None = None
    agent: dict[str, Any] | None = None
    model: Any = None
    example: Any = None
    description: Any = None


class CreateRunRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    run_id: Annotated[
        str,
        Meta(
            pattern="^[a-z0-9][a-z0-9-]*$",
            min_length=1,
            max_length=40,
            description="a slug: lowercase letters, digits and '-'",
        ),
    ]
    config: RunConfig
    adapter: (
        Annotated[
            str,
            Meta(
                min_length=1,
                max_length=200,
                pattern=r"^\S(.*\S)?$",
                description="the model name the run's agents call (default: the run id)",
            ),
        ]
        | None
    ) = None


class Run(Struct, kw_only=True):
    run_id: str
    adapter: str
    namespace: str
    config: dict[str, Any]
    status: RunStatus
    created_at: float
    updated_at: float
    key_sha256: str


class NewRun(Run, kw_only=True):
    api_key: Annotated[str, Meta(description="the run's API key: shown here once, never stored")]


class RunList(Struct):
    runs: list[Run]
