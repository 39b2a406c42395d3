"""A deployment's batching policy checked against the model's signature at deploy, and the
batch sizes it asks for carried into the compile options.

Agents gather requests along the first axis of every input and output, so that axis must be
dynamic in the model's signature, and an input's shape profile (the range its engine is
built for) must reach the policy's maximum batch. When the policy names preferred batch
sizes, the largest becomes the ``opt`` of the batch axis of each input's profile: the
engine is built for it (TensorRT's optimization profile) and the worker's verification,
benchmark and tuner measure at that batch, which is the one the deployment will run.
"""

from __future__ import annotations

from schemas.deployments import BatchingPolicy
from schemas.errors import InvalidOptions
from schemas.models import ModelInfo
from schemas.options import CompileOptions, ShapeProfile


def batching_options(model: ModelInfo, options: CompileOptions,
                     policy: BatchingPolicy | None) -> CompileOptions:
    """``options`` with the preferred batch size in its shape profiles; ``InvalidOptions``
    (422) naming the limit for a policy the model's engine cannot honour."""
    if policy is None:
        return options
    where = f"model {model.id[:16]}"
    specs = [*model.inputs, *model.outputs]
    static = [f"{s.name} {s.shape}" for s in specs
              if not s.shape or s.shape == ["..."] or isinstance(s.shape[0], int)]
    if static:
        raise InvalidOptions(
            f"batching needs a dynamic first (batch) axis on every input and output of "
            f"{where}; these have a static one (or none): {static}. Deploy without "
            f"'batching', or export the model with a dynamic batch axis",
            field="batching", static=static)
    shapes = dict(options.shapes)
    preferred = policy.preferred_batch_sizes[-1] if policy.preferred_batch_sizes else None
    for spec in model.inputs:
        profile = shapes.get(spec.name)
        if profile is not None:
            limit = profile.max[0]
            if policy.max_batch_size > limit:
                raise InvalidOptions(
                    f"batching.max_batch_size is {policy.max_batch_size}, above the batch "
                    f"axis of input {spec.name!r}'s shape profile (max {limit}): the engine is "
                    f"built for at most {limit} rows. Lower max_batch_size to {limit} or "
                    f"raise options.shapes[{spec.name!r}].max[0]",
                    field="batching.max_batch_size", limit=limit, input=spec.name)
            if preferred is not None and profile.opt[0] != preferred:
                low = min(profile.min[0], preferred)
                shapes[spec.name] = ShapeProfile(min=[low, *profile.min[1:]],
                                                 opt=[preferred, *profile.opt[1:]],
                                                 max=list(profile.max))
        elif preferred is not None and all(isinstance(d, int) for d in spec.shape[1:]):
            rest = [int(d) for d in spec.shape[1:]]
            shapes[spec.name] = ShapeProfile(min=[1, *rest], opt=[preferred, *rest],
                                             max=[policy.max_batch_size, *rest])
    if shapes == options.shapes:
        return options
    return options.model_copy(update={"shapes": shapes})
