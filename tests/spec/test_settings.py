"""Speculation settings: the daemon's (`--speculate`, `--draft-tokens`) and a request's `speculate` field."""

from __future__ import annotations

import pytest

from swarmd.config import DaemonConfig
from swarmd.errors import UserError
from swarmd.spec_settings import SpecError, SpecRequest, SpecSettings, parse_spec_field


def test_a_request_takes_the_daemons_setting_unless_it_asks_for_its_own():
    daemon = SpecSettings("ngram", 6)
    assert SpecRequest().resolve(daemon) == daemon
    assert parse_spec_field({"mode": "off"}).resolve(daemon).on is False
    assert parse_spec_field({"draft_tokens": 2}).resolve(daemon) == SpecSettings("ngram", 2)
    assert parse_spec_field("model:smollm2-135m").resolve(daemon).draft_model == "smollm2-135m"
    assert parse_spec_field(None) is None


@pytest.mark.parametrize("field, words", [
    ({"mode": "bigram"}, "unknown speculation mode"),
    ({"mode": "model:"}, "unknown speculation mode"),
    ({"mode": 3}, "must be a string"),
    ({"draft_tokens": 0}, "at least 1"),
    ({"draft_tokens": True}, "at least 1"),
    ({"draft_tokens": 2.5}, "at least 1"),
    ({"k": 2}, "unknown key"),
    (["ngram"], "must be an object"),
])
def test_a_bad_speculate_field_is_refused_with_what_to_send_instead(field, words):
    with pytest.raises(SpecError, match=words):
        parse_spec_field(field)


def test_a_request_may_not_draft_more_than_the_daemon_allows():
    with pytest.raises(SpecError, match="1 to 4"):
        SpecRequest(draft_tokens=5).resolve(SpecSettings("ngram", 4))


def test_the_daemon_refuses_to_start_with_a_bad_setting():
    assert DaemonConfig(speculate="model:smollm2-135m", draft_tokens=8).draft_tokens == 8
    with pytest.raises(UserError, match="unknown speculation mode"):
        DaemonConfig(speculate="always")
    with pytest.raises(UserError, match="draft_tokens must be 1 to"):
        DaemonConfig(speculate="ngram", draft_tokens=0)
