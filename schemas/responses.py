"""OpenAI's Responses API, its stateless subset: POST /v1/responses bodies, answers and stream events.

A Responses body describes a chat completion in other words: `instructions`
is a system turn, `input` the conversation (messages, and the function calls
and their results a client sends back), `text.format` the response_format,
and its flat function tools chat's nested ones. `ResponsesRequest.chat` is
that chat request, made while the body is validated, so that whatever chat
would refuse is refused here as a 400 of this body; the route serves it with
the chat route's own code.

This server keeps no responses: `store: true` and `previous_response_id`,
which need them kept, are refused by name; `store` omitted (as the SDK sends
it) or false is served, and nothing is kept. Any field not listed here is
ignored and named, as on the other routes (schemas/body.py).

The answers and events are OpenAI's shapes, field for field, as the official
SDK parses them by their `type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, PrivateAttr, RootModel, Tag, ValidationError, model_validator

from schemas.body import Body
from schemas.multimodal import MAX_ITEMS
from schemas.openai import (
    ChatCompletionRequest,
    ChatMessageIn,
    ImageUrl,
    ImageUrlPart,
    JsonSchemaFormat,
    ResponseFormat,
    StreamOptions,
    TextPart,
)
from schemas.openai_tools import (
    FUNCTION_NAME,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from schemas.parameters import INT32_MAX

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputText(Body):
    type: Literal["input_text"]
    text: str

    def as_chat(self) -> TextPart:
        return TextPart(type="text", text=self.text)


class InputImage(Body):
    type: Literal["input_image"]
    image_url: str = Field(
        min_length=1, description="A data: URI, a file under the media directory, or an allowed URL."
    )
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides the size

    def as_chat(self) -> ImageUrlPart:
        return ImageUrlPart(type="image_url", image_url=ImageUrl(url=self.image_url, detail=self.detail))


class OutputText(Body):
    """A text part of an answer; in an input, of an earlier assistant turn."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict] = Field(default_factory=list, description="Accepted in input; always empty here.")
    logprobs: list[dict] | None = Field(default_factory=list, description="Accepted in input; always empty here.")

    def as_chat(self) -> TextPart:
        return TextPart(type="text", text=self.text)


ContentPart = Annotated[InputText | InputImage | OutputText, Field(discriminator="type")]


class MessageItem(Body):
    """A turn of the conversation; an assistant's may be an earlier answer's message, sent back as it came."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None

    @property
    def images(self) -> int:
        parts = () if isinstance(self.content, str) else self.content
        return sum(isinstance(part, InputImage) for part in parts)

    def as_chat(self) -> ChatMessageIn:
        content = self.content if isinstance(self.content, str) else [part.as_chat() for part in self.content]
        return ChatMessageIn(role=self.role, content=content)


class FunctionCallItem(Body):
    """A call the model made (an answer's output item), sent back with its result."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str = Field(description="JSON text.")
    id: str | None = None
    status: ItemStatus | None = None

    def as_chat(self) -> ToolCall:
        return ToolCall(id=self.call_id, function=FunctionCall(name=self.name, arguments=self.arguments))


class FunctionCallOutputItem(Body):
    """A call's result, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, description="The call it answers.")
    output: str
    id: str | None = None
    status: ItemStatus | None = None

    def as_chat(self) -> ChatMessageIn:
        return ChatMessageIn(role="tool", tool_call_id=self.call_id, content=self.output)


def _item_type(item: Any) -> str:
    """An input item's kind: a message's `type` may be left out."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_type,
        custom_error_type="invalid_item",
        custom_error_message="an item's type is message (the default), function_call or function_call_output",
    ),
]


class FunctionTool(Body):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = Field(None, description="A JSON schema; default: any object.")
    strict: bool | None = Field(None, description="Arguments always match `parameters` here, strict or not.")

    def as_chat(self) -> Tool:
        definition = self.model_dump(exclude={"type"}, exclude_none=True)
        return Tool(type="function", function=FunctionDefinition(**definition))


class FunctionToolChoice(Body):
    type: Literal["function"]
    name: str


class PlainTextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]


class JsonSchemaTextFormat(JsonSchemaFormat):
    type: Literal["json_schema"]


TextFormat = Annotated[PlainTextFormat | JsonObjectFormat | JsonSchemaTextFormat, Field(discriminator="type")]


class TextConfig(Body):
    format: TextFormat = Field(default_factory=lambda: PlainTextFormat(type="text"), description="Default: text.")


class ResponsesRequest(Body):
    """POST /v1/responses."""

    model: str = Field(description="A served model name (GET /v1/models).")
    input: str | Annotated[list[InputItem], Field(min_length=1)] = Field(
        description="A user message's text, or the conversation's items."
    )
    instructions: str | None = Field(None, description="A system message before the input.")
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="Default: the server's maxIterTimes.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0: greedy; default 1.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Default 1.")
    tools: list[FunctionTool] | None = Field(None, max_length=128, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = Field(
        None, description="Default: auto with tools, none without."
    )
    parallel_tool_calls: bool | None = Field(
        None, description="With tool_choice required: more than one call allowed; default true."
    )
    text: TextConfig | None = Field(None, description="The answer's format: text, any JSON object, or a schema's.")
    stream: bool | None = Field(None, description="Typed events as server-sent events.")
    store: bool | None = Field(None, description="Only false (or omitted): this server keeps no responses.")
    previous_response_id: None = Field(None, description="Refused: this server keeps no responses; send the input.")

    _chat: ChatCompletionRequest = PrivateAttr()

    @model_validator(mode="before")
    @classmethod
    def _stateless(cls, body: Any) -> Any:
        if isinstance(body, dict) and body.get("store") is True:
            raise ValueError("store: this server keeps no responses; send store false, or leave it out")
        if isinstance(body, dict) and body.get("previous_response_id") is not None:
            raise ValueError(
                "previous_response_id: this server keeps no responses; send the whole conversation in input"
            )
        return body

    @model_validator(mode="after")
    def _as_chat(self) -> ResponsesRequest:
        if self.forces_call and self.answer_format.type != "text":
            raise ValueError("text.format cannot be combined with a tool_choice that forces a call")
        items = () if isinstance(self.input, str) else self.input
        images = sum(item.images for item in items if isinstance(item, MessageItem))
        if images > MAX_ITEMS:
            raise ValueError(f"input: {images} input_image parts; at most {MAX_ITEMS} per request")
        try:
            self._chat = ChatCompletionRequest(
                model=self.model,
                messages=self._messages(),
                max_completion_tokens=self.max_output_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                tools=[tool.as_chat() for tool in self.tools] if self.tools else None,
                tool_choice=self._chat_tool_choice(),
                parallel_tool_calls=self.parallel_tool_calls is not False,
                response_format=self._response_format(),
                stream=bool(self.stream),
                stream_options=StreamOptions(include_usage=True) if self.stream else None,
            )
        except ValidationError as refused:  # chat's own checks (tool names, tool_choice), in its words
            raise ValueError(
                "; ".join(str(e.get("ctx", {}).get("error", e["msg"])) for e in refused.errors())
            ) from None
        return self

    @property
    def chat(self) -> ChatCompletionRequest:
        """The chat completion this body asks for (usage included, when streamed)."""
        return self._chat

    @property
    def answer_format(self) -> TextFormat:
        return (self.text or TextConfig()).format

    @property
    def forces_call(self) -> bool:
        return self.tool_choice not in (None, "none", "auto")

    def _messages(self) -> list[ChatMessageIn]:
        """The chat turns: instructions first; a function call joins the assistant turn it follows, if any."""
        messages = [] if self.instructions is None else [ChatMessageIn(role="system", content=self.instructions)]
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if not isinstance(item, FunctionCallItem):
                messages.append(item.as_chat())
            elif messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or ()), item.as_chat()]
            else:
                messages.append(ChatMessageIn(role="assistant", tool_calls=[item.as_chat()]))
        return messages

    def _chat_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
        if isinstance(self.tool_choice, FunctionToolChoice):
            return NamedToolChoice(type="function", function=FunctionName(name=self.tool_choice.name))
        return self.tool_choice

    def _response_format(self) -> ResponseFormat | None:
        answer = self.answer_format
        if isinstance(answer, PlainTextFormat):
            return None
        if isinstance(answer, JsonObjectFormat):
            return ResponseFormat(type="json_object")
        schema = JsonSchemaFormat(**answer.model_dump(by_alias=True, exclude={"type"}))
        return ResponseFormat(type="json_schema", json_schema=schema)


# The answer


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class OutputMessage(BaseModel):
    id: str = Field(description="msg_…")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    """A call the model made: its result goes back as a function_call_output item with its call_id."""

    id: str = Field(description="fc_…")
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(description="call_…")
    name: str
    arguments: str = Field(description="JSON text.")
    status: ItemStatus


OutputItem = Annotated[OutputMessage | FunctionCallOutput, Field(discriminator="type")]


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: Literal["server_error"]
    message: str


class ResponseObject(BaseModel):
    """A response: its output items, and the request's settings as they were applied."""

    id: str = Field(description="resp_…")
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = Field(None, description="Why a response is incomplete.")
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice
    tools: list[FunctionTool]
    text: TextConfig
    store: Literal[False] = False
    usage: ResponseUsage | None = Field(None, description="Once the response has ended.")


# The stream's events, each with its place in the stream (`sequence_number`, from 0)


class _Event(BaseModel):
    sequence_number: int


class _LifecycleEvent(_Event):
    response: ResponseObject


class ResponseCreated(_LifecycleEvent):
    type: Literal["response.created"] = "response.created"


class ResponseInProgress(_LifecycleEvent):
    type: Literal["response.in_progress"] = "response.in_progress"


class ResponseCompleted(_LifecycleEvent):
    type: Literal["response.completed"] = "response.completed"


class ResponseIncomplete(_LifecycleEvent):
    type: Literal["response.incomplete"] = "response.incomplete"


class ResponseFailed(_LifecycleEvent):
    type: Literal["response.failed"] = "response.failed"


class _ItemEvent(_Event):
    output_index: int
    item: OutputItem


class OutputItemAdded(_ItemEvent):
    type: Literal["response.output_item.added"] = "response.output_item.added"


class OutputItemDone(_ItemEvent):
    type: Literal["response.output_item.done"] = "response.output_item.done"


class _PartEvent(_Event):
    item_id: str
    output_index: int
    content_index: int


class _WholePartEvent(_PartEvent):
    part: OutputText


class ContentPartAdded(_WholePartEvent):
    type: Literal["response.content_part.added"] = "response.content_part.added"


class ContentPartDone(_WholePartEvent):
    type: Literal["response.content_part.done"] = "response.content_part.done"


class OutputTextDelta(_PartEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[dict] = Field(default_factory=list)


class OutputTextDone(_PartEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[dict] = Field(default_factory=list)


class _CallEvent(_Event):
    item_id: str
    output_index: int


class FunctionCallArgumentsDelta(_CallEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class FunctionCallArgumentsDone(_CallEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    name: str
    arguments: str


class ResponseErrorEvent(_Event):
    """A stream that fails after it started: this, then response.failed."""

    type: Literal["error"] = "error"
    code: str | None
    message: str
    param: str | None = None


class ResponseStreamEvent(
    RootModel[
        Annotated[
            ResponseCreated
            | ResponseInProgress
            | ResponseCompleted
            | ResponseIncomplete
            | ResponseFailed
            | OutputItemAdded
            | OutputItemDone
            | ContentPartAdded
            | ContentPartDone
            | OutputTextDelta
            | OutputTextDone
            | FunctionCallArgumentsDelta
            | FunctionCallArgumentsDone
            | ResponseErrorEvent,
            Field(discriminator="type"),
        ]
    ]
):
    """One event of a streamed response, told apart by its `type`."""
