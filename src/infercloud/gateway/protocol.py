"""The request bodies the gateway reads: only the fields it acts on are typed and checked here.

Every other field passes through to the replica untouched (`extra="allow"`), which validates the
rest, so a client's newer OpenAI fields still reach an upstream that knows them. The schemas
appear in the gateway's OpenAPI document.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

INT32_MAX = 2**31 - 1
"""Limits are stored in 32-bit integer columns, and token counts are at most that too."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256)
    metadata: dict[str, Any] | None = None

    def forwarded(self) -> dict[str, Any]:
        """The body as the replica gets it (every field the client sent, extras included)."""
        return self.model_dump(exclude_unset=True)


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)

    def prompt_text(self) -> str:
        parts: list[str] = []
        for m in self.messages:
            if isinstance(m.content, str):
                parts.append(m.content)
            elif m.content:
                parts.extend(str(p.get("text", "")) for p in m.content)
        return "\n".join(parts)

    @property
    def output_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(p for p in self.prompt if isinstance(p, str))

    def prompt_token_count(self) -> int | None:
        """Tokens given directly as ids (None when the prompt is text)."""
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], str):
            if isinstance(self.prompt[0], int):
                return len(self.prompt)
            return sum(len(p) for p in self.prompt if isinstance(p, list))
        return None

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens


ADMIN_TENANT = "admin"
"""The tenant that requests made with the admin key are recorded under; no key can be made for
it, so that no tenant's key reads the admin key's usage."""


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@-]+$")
    rpm: int | None = Field(default=None, ge=1, le=INT32_MAX)
    tpm: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_concurrent: int | None = Field(default=None, ge=1, le=INT32_MAX)
    priority: str = Field(default="standard", pattern=r"^(interactive|standard|batch)$")
    budget_usd: float | None = Field(default=None, ge=0, le=1e12, allow_inf_nan=False)

    @field_validator("tenant")
    @classmethod
    def _not_the_admin_tenant(cls, tenant: str) -> str:
        if tenant == ADMIN_TENANT:
            raise ValueError(f"the tenant name {ADMIN_TENANT!r} is reserved for the admin key")
        return tenant


Layer = Literal["model", "context", "runtime", "hardware", "routing", "verifier"]
"""Where a task's failure is attributed (`ledger.tasks.LAYERS`)."""


class TaskOutcomeBody(BaseModel):
    """`POST /v1/tasks/{task_id}/outcome`: how a task ended, as its client or verifier saw it."""

    model_config = ConfigDict(extra="forbid")

    success: bool
    verifier: str | None = Field(default=None, max_length=128)
    tool_calls: int = Field(default=0, ge=0, le=INT32_MAX)
    retries: int = Field(default=0, ge=0, le=INT32_MAX)
    """Retries the client made itself (the platform counts its own)."""
    blamed_layer: (
        Literal["model", "context", "runtime", "hardware", "routing", "verifier"] | None
    ) = None
    config: str | None = Field(default=None, max_length=64, pattern=r"^[A-Za-z0-9_.:@/-]+$")
    detail: str | None = Field(default=None, max_length=2000)
