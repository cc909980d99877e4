"""gds.gpu_route: the route chosen for each setting and GDS answer."""

from __future__ import annotations

import pytest

from pegaflow.gds import gpu_route


@pytest.mark.parametrize(
    ("setting", "present", "route"),
    [
        ("auto", True, "direct"),
        ("auto", False, "l1"),  # compat mode, as on the H200: the L1 route
        ("auto", None, "l1"),
        ("on", True, "direct"),
        ("on", False, "direct"),
        ("off", True, "l1"),
        ("off", None, "l1"),
    ],
)
def test_route_per_setting(setting: str, present: bool | None, route: str) -> None:
    choice = gpu_route.choose(setting, present)  # type: ignore[arg-type]
    assert choice.route == route and choice.reason


def test_on_without_kvikio_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="gpu_direct: 'on' needs kvikio"):
        gpu_route.choose("on", None)


def test_gds_present_is_none_without_kvikio() -> None:
    pytest.importorskip("numpy")
    try:
        import kvikio  # noqa: F401
    except ImportError:
        assert gpu_route.gds_present() is None
    else:
        pytest.skip("kvikio is installed here")
