"""What `--torch_compile` compiles in a training: each decoder layer, and the norms outside them. The depth loop stays
eager, so a new depth does not recompile, and saved keys carry no `_orig_mod.` prefix."""


def compile_decoder_layers(model, mode: str = "default", backend: str = "inductor") -> int:
    """`torch.compile` each decoder layer in place (its options kept as `compile_options`, for the checkpoint function a
    memory plan may give it) and each RMSNorm outside them (prelude, state and final norms: eager, one keeps its input
    in fp32 and its bf16 output for backward, where compiled it keeps its bf16 input); returns how many layers."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    inside = {id(m) for layer in layers for m in layer.modules()}
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and id(m) not in inside]
    for module in layers + norms:
        module.compile(mode=mode, backend=backend)
    for layer in layers:
        layer.compile_options = {"mode": mode, "backend": backend}
    return len(layers)
