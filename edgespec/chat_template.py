"""Rendering chat messages with the model's own template (GGUF metadata).

Templates are untrusted input from a downloaded file, so they run in Jinja's
immutable sandbox.
"""

from __future__ import annotations

from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import EdgespecError

# For GGUF files without a template: plain role-prefixed turns.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _raise_exception(message: str):
    raise TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str, eos_token: str):
        self.source = source or FALLBACK_TEMPLATE
        self.is_fallback = source is None
        self._template = _environment().from_string(self.source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        try:
            return self._template.render(
                messages=plain,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise EdgespecError(f"the model's chat template failed: {exc} (use --raw to send the prompt as is)") from None
