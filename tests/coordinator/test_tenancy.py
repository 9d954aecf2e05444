"""Tenants: the tokens file, and the per-tenant limit on generations at once."""

from __future__ import annotations

import pytest

from coordinator.tenancy import RequestQuota, read_tenant_tokens, tenant_of_certificate
from specdec_core.errors import ResourceExhausted

pytestmark = pytest.mark.durability


def test_tokens_file_maps_tokens_to_tenants(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# team tokens\nalpha:tok-a\n\nbeta:tok:with:colons-b\nbare-token\n")
    assert read_tenant_tokens(str(path)) == {"tok-a": "alpha", "tok:with:colons-b": "beta", "bare-token": "default"}


def test_tokens_file_errors_name_the_line(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("alpha:tok-a\nbad tenant:tok-b\n")
    with pytest.raises(ValueError, match=r"tokens:2: expected 'tenant:token'"):
        read_tenant_tokens(str(path))
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no tokens"):
        read_tenant_tokens(str(path))


def test_request_quota_is_per_tenant_and_released():
    quota = RequestQuota(limit=2)
    with quota.held("a"), quota.held("a"):
        with pytest.raises(ResourceExhausted, match="tenant 'a' has 2 generations running"):
            with quota.held("a"):
                pass
        with quota.held("b"):  # other tenants are not affected
            pass
    with quota.held("a"), quota.held("a"):  # released, also after the refusal
        pass
    with pytest.raises(RuntimeError):
        with quota.held("a"):
            raise RuntimeError("a failed generation")
    assert quota._running == {}
    unlimited = RequestQuota()
    with unlimited.held("a"), unlimited.held("a"), unlimited.held("a"):
        pass


def test_certificate_names_map_to_distinct_tenants():
    assert tenant_of_certificate("team-a") == "team-a"
    odd = ["alice!", "cn-alice_", "x" * 70, "x" * 70 + "y", "CN with spaces"]
    tenants = [tenant_of_certificate(name) for name in odd]
    assert len(set(tenants)) == len(odd)  # no two names share a tenant
    assert all(t.startswith("cn-") and len(t) <= 64 for t in tenants)
