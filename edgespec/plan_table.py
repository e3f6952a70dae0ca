"""`edgespec plan`'s table: a memory plan's sizes per model, then the budget, the choice and why."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from edgespec.control_chars import terminal_text
from edgespec.errors import flag_worded
from edgespec.planner import ModelMemory, Plan
from edgespec.units import format_size


def format_plan_table(plan: Plan) -> Table:
    """The plan as a small table for `edgespec plan` and the chat app: sizes per model, then the budget, the
    choice and why, the settings named as flags."""
    device = {"cuda": "CUDA GPU", "metal": "Metal GPU"}.get(plan.device, "CPU")
    verdict = "fits" if plan.fits else "[bold red]does not fit[/]"
    caption = [
        f"budget {format_size(plan.budget_bytes)} ({_shown(flag_worded(plan.budget_source))}); "
        f"plan needs {format_size(plan.total_bytes)}: {verdict}",
        f"drafting: [bold]{plan.drafting}[/]; {_shown(plan.reason)}",
        *(f"[yellow]warning:[/] {_shown(flag_worded(warning))}" for warning in plan.warnings),
    ]
    if plan.prompt_cache_ram:
        caption.insert(1, _prompt_cache_line(plan))
    table = Table(title=f"edgespec plan: {plan.drafting} on {device}", title_justify="left",
                  caption="\n".join(caption), caption_justify="left")
    table.add_column("")
    for part in plan.parts:
        table.add_column(f"{part.role}\n{_shown(part.model)}", justify="right")
    table.add_row("GPU layers", *(_layers_text(part, plan.device) for part in plan.parts))
    table.add_row("weights", *(format_size(part.weights_bytes) for part in plan.parts))
    sequences = f" x {plan.parallel}" if plan.parallel > 1 else ""
    table.add_row(f"KV cache ({plan.n_ctx} tokens{sequences})", *(format_size(p.kv_bytes) for p in plan.parts))
    table.add_row("KV cache types", *(plan.cache_types(part.role) for part in plan.parts))
    table.add_row("flash attention", *("on" if plan.flash_attn else "off" for _ in plan.parts))
    table.add_row("compute buffers", *(format_size(part.compute_bytes) for part in plan.parts))
    if plan.device == "cpu":
        table.add_row("tokenizer and header", *(format_size(part.runtime_bytes) for part in plan.parts))
    table.add_row("total", *(format_size(part.budget_bytes) for part in plan.parts), end_section=True)
    if plan.device != "cpu":
        table.add_row("[dim]left in RAM[/]", *(f"[dim]{format_size(part.host_bytes)}[/]" for part in plan.parts))
    return table


def _shown(text: str) -> str:
    """Text that may name a model's file, as markup that prints it as it is: a file's name is neither markup
    nor, with its escape sequences, orders to the terminal."""
    return escape(terminal_text(text))


def _layers_text(part: ModelMemory, device: str) -> str:
    if device == "cpu":
        return "CPU"
    if part.gpu_layers > part.n_layer:
        return f"all {part.n_layer} + output"
    if part.gpu_layers == part.n_layer:
        return f"all {part.n_layer}, output on CPU"
    return f"{part.gpu_layers} of {part.n_layer}"


def _prompt_cache_line(plan: Plan) -> str:
    """The server's RAM store of prompt snapshots: its cap, and how many full contexts that holds."""
    # a snapshot of n tokens is about n tokens of KV cache; the draft model's is kept beside the target's
    full_context = sum(part.kv_bytes // (plan.parallel if part.role == "target" else 1) for part in plan.parts)
    where = "counted in the plan" if plan.device == "cpu" else "in RAM, outside the GPU budget"
    return (f"prompt snapshots the server keeps in RAM: up to {format_size(plan.prompt_cache_ram)}, "
            f"{plan.prompt_cache_ram // max(1, full_context)} of a full {plan.n_ctx}-token context ({where})")
