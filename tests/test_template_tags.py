"""Template tags through the real e2b SDK, as E2B's API defines them: ``name:tag`` builds,
``tags=``, ``Template.assign_tags`` / ``remove_tags`` / ``get_tags`` / ``exists``, and
``Sandbox.create("name:tag")`` starting the build the tag names."""

from __future__ import annotations

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import SandboxException, TemplateException
from test_templates import _delete, _name


def _read(template: str) -> str:
    sbx = Sandbox.create(template, timeout=60)
    try:
        return sbx.files.read("/home/user/v").strip()
    finally:
        sbx.kill()


def test_tags_name_builds_and_move(server):
    name = _name("tag")
    try:
        one = Template.build(Template().from_template("base").run_cmd("echo one > /home/user/v"), f"{name}:v1")
        two = Template.build(Template().from_template("base").run_cmd("echo two > /home/user/v"), name,
                             tags=["v2", "Edge"])
        assert one.template_id == two.template_id == name and one.build_id != two.build_id
        tags = {t.tag: t.build_id for t in Template.get_tags(name)}
        assert tags == {"v1": one.build_id, "v2": two.build_id, "edge": two.build_id}, tags
        # each tag starts its own build; the older build's snapshot was kept for its tag
        assert _read(f"{name}:v1") == "one"
        assert Template.exists(name) and not Template.exists(f"{name}:v3")
        with pytest.raises(SandboxException, match="404"):
            Sandbox.create(name, timeout=30)  # no build has `default` (E2B: only builds without tags get it)
        # move tags onto the first build
        info = Template.assign_tags(f"{name}:v1", ["default", "stable"])
        assert info.build_id == one.build_id and sorted(info.tags) == ["default", "stable"]
        assert _read(name) == "one"
        Template.remove_tags(name, ["stable", "never-there"])
        assert "stable" not in {t.tag for t in Template.get_tags(name)}
        for bad in (lambda: Template.remove_tags(name, "default"),  # 400: the default tag stays
                    lambda: Template.assign_tags(f"{name}:nope", "x"),  # 404: no such tag
                    lambda: Template.assign_tags(f"{name}:v1", "Not A Tag!")):  # 400
            with pytest.raises(TemplateException):
                bad()
        with server.api() as c:
            assert c.post("/v3/templates", json={"name": f"{name}:Bad Tag"}).status_code == 400
    finally:
        _delete(server, name)
    assert not Template.exists(name)
    with server.api() as c:
        assert c.get(f"/templates/{name}/tags").status_code == 404
        left = [m for m in c.get("/snapshots").json() if name in m.get("names", [])]
    assert left == []
