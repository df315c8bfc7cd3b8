"""model -> FX graph, through dynamo with fullgraph=True.

The graph dynamo hands a backend takes parameters as inputs and the batch size as a
SymInt input. Passes want the torch.fx convention instead: parameters and buffers as
`get_attr` of their qualified names (so a pass can shard one by replacing an attribute),
placeholders only for the user's tensors, and the batch size read off the input with
`sym_size` (so one graph serves every rank's batch, even and uneven).
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..models.hf import choose_experts_implementation, training_forward
from .inputs import check_inputs, forward_exception
from .program import Program


class CaptureError(RuntimeError):
    """The model cannot be captured as one graph."""


def capture(model: torch.nn.Module, example_inputs, example_kwargs: dict | None = None) -> Program:
    """Trace `model(*example_inputs, **example_kwargs)` into a Program whose batch dimension
    (dim 0 of every tensor input) is symbolic, and the sequence dimension (dim 1) too where
    the model allows it.

    `example_inputs` may also be a dict of keyword tensors (HF style: input_ids=, labels=).
    Hugging Face models are taken as transformers returns them: the forward is traced
    without a KV cache and with an experts implementation that runs the model's dtype, and
    the Program gives back what the model gives (a `ModelOutput` with logits, and loss
    when labels are passed).
    """
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    check_inputs(model, args, kwargs)
    empty = [name for name, t in [*((f"input {i}", t) for i, t in enumerate(args)), *kwargs.items()] if t.dim() and t.shape[0] == 0]
    if empty:
        raise CaptureError(
            f"capture traces the forward on the example inputs, which have no rows ({', '.join(empty)}): models "
            "reshape by the batch (view(0, heads, -1)), which cannot run on an empty batch even eagerly. Pass an "
            "example with at least one row. (A rank may have no rows at run time: commfx.distribute and the CLI "
            "capture on a stand-in row, and that rank takes part in every collective and contributes nothing.)"
        )
    signature = _signature(model)
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as error:
            raise CaptureError(
                f"{type(model).__name__}.forward{signature} cannot take the example inputs "
                f"({', '.join([f'{len(args)} positional'] + [f'{k}=' for k in kwargs])}): {error}"
            ) from None
    choose_experts_implementation(model)
    torch._dynamo.reset()
    # Fresh row-major copies: a view's strides (ids[:1, :4] keeps the stride of its base)
    # would become symbols of their own that no input dimension explains.
    args = tuple(t.clone(memory_format=torch.contiguous_format) for t in args)
    kwargs = {k: t.clone(memory_format=torch.contiguous_format) for k, t in kwargs.items()}
    for t in (*args, *kwargs.values()):
        if t.dim() > 0 and t.shape[0] >= 2:
            torch._dynamo.mark_dynamic(t, 0)
        if t.dim() > 1 and t.shape[1] >= 2:
            # The sequence length too, where the model lets it vary (it stays a constant
            # where the model specialises it): one graph then serves every length, so ranks
            # lower new shapes locally without agreeing on anything.
            torch._dynamo.maybe_mark_dynamic(t, 1)
    recorded: list[tuple[fx.GraphModule, list]] = []

    def record(gm: fx.GraphModule, example: list):
        recorded.append((gm, list(example)))
        return gm.forward

    try:
        with training_forward(model):
            output = torch.compile(model, backend=record, fullgraph=True)(*args, **kwargs)
    except Exception as error:  # dynamo raises Unsupported, UserError, constraint violations...
        raised = forward_exception(model, args, kwargs)  # the model's own error, which eager hits too
        if raised is not None:
            raise CaptureError(
                f"{type(model).__name__}.forward raised {raised}. The model raises this itself (its eager forward "
                "does too, without commfx): fix it there."
            ) from None
        raise CaptureError(_graph_break_message(type(model).__name__, error)) from None
    finally:
        torch._dynamo.reset()
    if len(recorded) != 1:
        raise CaptureError(f"expected one graph from dynamo, got {len(recorded)}")
    leaves, out_spec = pytree.tree_flatten(output)
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        raise CaptureError(
            f"the model's output must be tensors (a tensor, a ModelOutput, or a tuple/list/dict of tensors); got "
            f"leaves of types {sorted({type(leaf).__name__ for leaf in leaves})}. Wrap the model so forward returns tensors."
        )
    gm, example = recorded[0]
    given = _names_of_given_inputs(args, kwargs, signature)
    names = parameter_names(model)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    positions = to_fx_convention(gm, example, names, len(args) + len(kwargs))
    return Program(
        gm=gm,
        modules=dict(model.named_modules()),
        out_spec=out_spec,
        tokens_per_rank=tokens_of((*args, *kwargs.values())),
        input_names=[given.get(id(example[i])) or _input_name(placeholders[i], signature) for i in positions],
        signature=signature,
    )


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """id(tensor) -> qualified name of every parameter and buffer; a tied tensor keeps its
    first name, the one `model.named_parameters()` reports (so gradients match by name)."""
    names: dict[int, str] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), name)
    return names


def split_inputs(example_inputs, example_kwargs: dict | None = None) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """(positional tensors, keyword tensors) from a tuple, a single tensor, or a dict of inputs."""
    if isinstance(example_inputs, dict):
        example_kwargs, example_inputs = {**example_inputs, **(example_kwargs or {})}, ()
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    kwargs = dict(example_kwargs or {})
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureError(
            f"example inputs must be a tuple of tensors or a dict of keyword tensors (the global batch, split "
            f"along dim 0), got {type(example_inputs).__name__}"
        )
    bad = [f"input {i}" for i, t in enumerate(example_inputs) if not isinstance(t, torch.Tensor)]
    bad += [f"{k}=" for k, t in kwargs.items() if not isinstance(t, torch.Tensor)]
    if bad:
        raise CaptureError(
            f"example inputs must be tensors (the batch, split along dim 0); {', '.join(bad)} is not. "
            "Pass settings such as use_cache or return_dict in the model's config, not as inputs."
        )
    return tuple(example_inputs), kwargs


def _signature(model: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _names_of_given_inputs(args: tuple, kwargs: dict, signature: inspect.Signature | None) -> dict[int, str]:
    """id(tensor) -> the forward's parameter name, for the tensors the caller passed.

    dynamo hands the backend the caller's own tensors, so a graph input is named by
    identity; its placeholder name is only a fallback, because wrappers around forward
    (transformers 5.24's decorators take *args) shift dynamo's l_args_<i>_ numbering."""
    if signature is None:
        return {}
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return {}
    names: dict[int, str] = {}
    for name, value in bound.items():
        values = value.items() if isinstance(value, dict) else [(name, value)]  # **kwargs
        for key, tensor in values:
            if isinstance(tensor, torch.Tensor):
                names[id(tensor)] = key
    return names


def _input_name(placeholder: str, signature: inspect.Signature | None) -> str:
    """dynamo's l_args_0_ / l_kwargs_labels_ / l_input_ids_ -> the forward's parameter name."""
    match = re.fullmatch(r"l_args_(\d+)_", placeholder)
    if match:
        index = int(match.group(1))
        positional = [
            p.name for p in (signature.parameters.values() if signature else ())
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        return positional[index] if index < len(positional) else f"*{index}"
    match = re.fullmatch(r"l_kwargs_(\w+?)_", placeholder) or re.fullmatch(r"l_(\w+?)_", placeholder)
    return match.group(1) if match else placeholder


def tokens_of(inputs: tuple[torch.Tensor, ...]) -> int:
    """Tokens in a batch, for cost models: every id of an integer input, or every row of
    a float input's last dimension ([batch, seq, hidden] -> batch * seq); 0 without inputs
    (a graph dynamo cut off from the model's inputs carries no tokens)."""
    if not inputs:
        return 0
    first = inputs[0]
    if first.dtype.is_floating_point and first.dim() > 1:
        return first.numel() // first.shape[-1]
    return first.numel()


def to_fx_convention(gm: fx.GraphModule, example: list, names: dict[int, str], num_inputs: int) -> list[int]:
    """Parameters/buffers become get_attr, SymInt inputs become sym_size of a user input.

    `names` maps id(tensor) to the qualified name of each parameter/buffer among dynamo's
    example inputs. Returns the positions of the user's tensors among dynamo's inputs.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example):
        raise CaptureError("internal: dynamo placeholders do not match its example inputs")
    user_nodes, sym_nodes, positions = [], [], []
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for position, (node, value) in enumerate(zip(placeholders, example)):
        if isinstance(value, (torch.SymInt, int)):
            sym_nodes.append(node)
        elif id(value) in names:
            _copy_attr(gm, names[id(value)], value)
            with graph.inserting_before(first):
                attr = graph.get_attr(names[id(value)])
            attr.meta.update(node.meta)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)
        elif isinstance(value, torch.Tensor) and _is_user_input(node):
            user_nodes.append(node)
            positions.append(position)
        else:
            raise CaptureError(
                f"graph input {node.name} is neither a parameter, a buffer nor a model input; "
                "register tensors the model uses as buffers"
            )
    if len(user_nodes) != num_inputs:
        raise CaptureError(f"expected {num_inputs} tensor inputs in the graph, found {len(user_nodes)}")
    for node in sym_nodes:
        query, *source = _find_dim(node, user_nodes)
        with graph.inserting_after(user_nodes[-1]):
            size = graph.call_function(query, tuple(source))
        size.meta["example_value"] = node.meta.get("example_value")
        node.replace_all_uses_with(size)
        graph.erase_node(node)
    graph.lint()
    # No longer dynamo's calling convention: drop the metadata that would make
    # aot_autograd treat it as a dynamo graph (parameters are attributes now).
    gm.meta.pop("dynamo_compile_id", None)
    if hasattr(gm, "_param_name_to_source"):
        del gm._param_name_to_source
    gm.recompile()
    return positions


def _is_user_input(node: fx.Node) -> bool:
    source = node.meta.get("grapharg")
    name = source.source.name if source is not None and hasattr(source, "source") else node.name
    name = name() if callable(name) else str(name)
    return "self" not in name.split(".")[0] and not re.search(r"_parameters|_buffers", name)


def _find_dim(sym_node: fx.Node, user_nodes: list[fx.Node]) -> tuple:
    """(aten.sym_size.int or aten.sym_stride.int, input node, dim) that gives a SymInt input:
    a size of a user input, or else a stride (a user's view of a larger tensor)."""
    symbol = sym_node.meta.get("example_value")
    expr = getattr(getattr(symbol, "node", None), "expr", None)
    for query, values in ((torch.ops.aten.sym_size.int, "shape"), (torch.ops.aten.sym_stride.int, "stride")):
        for node in user_nodes:
            value = node.meta.get("example_value")
            if not isinstance(value, torch.Tensor):
                continue
            sizes = value.shape if values == "shape" else value.stride()
            for dim, size in enumerate(sizes):
                if isinstance(size, torch.SymInt) and size.node.expr == expr:
                    return query, node, dim
    raise CaptureError(
        f"cannot tell which input dimension the size {sym_node.name} comes from; pass contiguous tensors as inputs"
    )


def _copy_attr(gm: fx.GraphModule, qualified_name: str, value: torch.Tensor) -> None:
    """Make `value` (a parameter or buffer) the attribute `qualified_name` of gm."""
    owner_path, _, leaf = qualified_name.rpartition(".")
    owner = gm
    for part in owner_path.split(".") if owner_path else []:
        if not isinstance(getattr(owner, part, None), torch.nn.Module):
            owner.add_module(part, torch.nn.Module())
        owner = getattr(owner, part)
    if hasattr(owner, leaf):
        return  # a tied weight seen twice
    if isinstance(value, torch.nn.Parameter):
        owner.register_parameter(leaf, value)
    else:
        owner.register_buffer(leaf, value)


def _graph_break_message(model_name: str, error: Exception) -> str:
    text = str(error)
    user_frames = [
        (path, line)
        for path, line in re.findall(r'File "([^"]+)", line (\d+)', text)
        if "/torch/" not in path and "/site-packages/" not in path
    ]
    user_frames += [(path, line) for path, line in re.findall(r"# (\S+\.py):(\d+) in", text) if "/torch/" not in path]
    location = f" at {user_frames[-1][0]}:{user_frames[-1][1]}" if user_frames else ""
    return (
        f"{model_name} has a graph break{location} ({type(error).__name__}): {_first_lines(text, 4)}\n"
        "commfx captures the whole forward as one graph (dynamo fullgraph=True) with a symbolic batch "
        "dimension (dim 0). Fix the line above: avoid data-dependent Python control flow (if t.item() ...), "
        ".tolist()/.item() on tensors, branches on x.shape[0] and unsupported builtins; for HF MoE models "
        "use experts_implementation='batched_mm' or 'grouped_mm'."
    )


def _first_lines(text: str, n: int) -> str:
    return "\n".join(text.strip().splitlines()[:n])
