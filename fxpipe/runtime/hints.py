"""What an error torch raises inside a stage means for the user, where fxpipe's own way of running
the stage is the cause: a hint appended to the stage's error, with the fix."""
from __future__ import annotations

# (pieces of torch's messages, what any of them means here and how to fix it)
_HINTS = [
    (
        ("Tensor dtype mismatch!", "without overflow"),
        "torch.export captured this model's graph with the dtypes of the example's run (it checks them, and "
        "holds constants of those dtypes, such as a mask's torch.finfo(dtype).min): this call runs it with "
        "others, under autocast or after a cast of the pipeline, where the captured graph would compute "
        "otherwise than the model does.\nHow to fix: cast the model before compiling it, and compile it under "
        "the autocast it runs in (with torch.autocast(...): compile_pipeline(...)), or let torch.fx trace it "
        "(the compile warning says why it could not).",
    ),
    (
        ("incompatible with .grad() or passing an `inputs` parameter",),
        "schedule='zb-h1' computes each stage's input gradients apart from its weights' "
        "(torch.autograd.grad with inputs=...), which torch.utils.checkpoint(use_reentrant=True) inside the "
        "model does not support.\nHow to fix: torch.utils.checkpoint(..., use_reentrant=False), or another "
        "schedule ('1f1b').",
    ),
    (
        ("Expected more than 1 value per channel when training",),
        "BatchNorm in training mode normalises each micro-batch by its own statistics, and this micro-batch "
        "holds one value per channel, where the whole batch the plain model is called on holds more.\nHow to "
        "fix: fewer chunks, or a larger batch, so that each micro-batch holds more than one sample (or more "
        "than one value per channel).",
    ),
    (
        ("modified by an inplace operation",),
        "Where the model's forward writes a parameter or a buffer in place (self.scale.clamp_(...) under "
        "torch.no_grad(), a counter self.n.add_(1) that an op then multiplies by), each micro-batch's forward "
        "writes it before the backward of the micro-batches before it, which holds it: the plain model, with one "
        "forward per backward, never does. Where it writes a value it computed and autograd saved "
        "(torch.tanh(h).mul_(2)), the plain model's backward fails alike, and so does chunks=1, which tells the "
        "two apart.\nHow to fix: keep a parameter in range outside forward (after "
        "optimizer.step(), under torch.no_grad()); have ops read a copy of a buffer (self.n.clone()), or "
        "checkpoint='always', whose recompute reads the value each micro-batch's forward read; or chunks=1. A "
        "computed value the model writes is the model's own error: write it out of place (h = h * 2).",
    ),
    (
        ("Cannot access storage of SparseTensorImpl",),
        "compile_stages: inductor cannot compile a sparse gradient (of an nn.Embedding(sparse=True), say) in "
        "this stage's backward; torch.compile of the plain model fails alike.\nHow to fix: "
        "compile_stages={'backend': 'aot_eager'}, which runs the compiled graphs without inductor's kernels, or "
        "a dense embedding (sparse=False).",
    ),
    (
        ("BackendCompilerFailed",),
        "compile_stages: torch.compile could not compile this stage; the failure may be the model's own (an "
        "in-place write to a value autograd saved fails the plain model's backward too), which torch.compile "
        "meets while it traces the backward.\nHow to fix: compile_stages=False runs the stage as the model "
        "runs, and shows the model's own error where it has one.",
    ),
    (
        ("Trying to backward through the graph a second time",),
        "Each micro-batch's backward runs on its own: a tensor computed with gradients outside the forward and "
        "outside loss_fn, that the model reads (a tensor a hook or the caller made from parameters) or that "
        "loss_fn reads (a temperature log_t.exp(), say), has one graph, which the first micro-batch's backward "
        "frees.\nHow to fix: compute that tensor where it is read, inside the forward or inside loss_fn "
        "(lambda out, t: F.mse_loss(out * log_t.exp(), t)), or pass it detached if it is not to learn. (A target "
        "computed with gradients is handled: its gradient goes through its graph once, after the step.)",
    ),
]


# The hints that speak of several micro-batches (what one's forward does to another's, or each
# holding fewer samples than the batch): none with one alone, where the plain model fails alike.
_OF_SEVERAL = ("modified by an inplace operation", "Expected more than 1 value per channel when training")


def hint_for(error: BaseException, micro_batches: int = 2) -> str:
    """The hint for `error` ('' for none), to append to the stage's error message; a step of
    one micro-batch fails as the plain model does, where no hint about several applies."""
    # Its kinds by name (an InductorError is a BackendCompilerFailed), torch's classes unimported.
    kinds = [kind.__name__ for kind in type(error).__mro__]
    text = f"{' '.join(kinds)}: {error}"
    # torch.compile's failure met while it traced one micro-batch's backward: not between two.
    alone = micro_batches == 1 or "BackendCompilerFailed" in kinds
    if "\nHow to fix: " in str(error):  # fxpipe's own refusal, which says what it was and its fix
        return ""
    return "".join(
        f"\n{hint}" for pieces, hint in _HINTS
        if any(piece in text for piece in pieces) and not (alone and set(pieces) & set(_OF_SEVERAL))
    )
