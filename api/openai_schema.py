"""Request and response bodies of the OpenAI-compatible chat API (the subset we serve, validated strictly)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Parts ---------------------------------------------------------------------------------------------------------


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    url: str = Field(description="data: URL (data:image/png;base64,...). Remote URLs are refused.")
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class VideoUrl(BaseModel):
    url: str = Field(description="data: URL of an MP4/WebM/MOV/AVI file. Remote URLs are refused.")


class VideoUrlPart(BaseModel):
    """A video file (the vLLM spelling): frames are sampled by the engine."""

    type: Literal["video_url"]
    video_url: VideoUrl
    fps: float | None = Field(None, gt=0, le=30, description="Frames sampled per second (default 2).")


class VideoFramesPart(BaseModel):
    """A video given as its frames (data: URL images), `fps` apart."""

    type: Literal["video"]
    video: list[str] = Field(min_length=1, max_length=256, description="Frames as data: URL images.")
    fps: float = Field(2.0, gt=0, le=30)


ContentPart = Annotated[TextPart | ImageUrlPart | VideoUrlPart | VideoFramesPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None


# Request -------------------------------------------------------------------------------------------------------


class JsonSchemaFormat(BaseModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown OpenAI parameters are ignored, like other servers do

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=1, description="Only n=1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None


# Response ------------------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "docpipe"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
