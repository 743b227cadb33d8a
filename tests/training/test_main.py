"""``python -m training``: the process settings it makes before torch starts."""

from __future__ import annotations

from training.__main__ import PINNED_HOST_ALLOC, allocator_settings


def test_pinned_host_allocation_is_added_to_the_users_allocator_settings() -> None:
    env: dict[str, str] = {}
    allocator_settings(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": PINNED_HOST_ALLOC}
    allocator_settings(env)  # once
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": PINNED_HOST_ALLOC}
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}  # the user's variable keeps theirs
    allocator_settings(env)
    assert env == {"PYTORCH_ALLOC_CONF": f"expandable_segments:True,{PINNED_HOST_ALLOC}"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}  # their choice wins
    allocator_settings(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:False"}
