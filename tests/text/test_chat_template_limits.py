"""Chat-template rendering limits (kvcore/text/chat_template.py): a hostile template ends in ChatTemplateError
quickly and without building its huge values; real templates render exactly as before."""

from __future__ import annotations

import time

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvcore.errors import ChatTemplateError, ConfigError
from kvcore.text.chat_template import MAX_TEMPLATE_CHARS, TemplateRaised, _tojson, compile_template, render_template

MESSAGES = [{"role": "user", "content": "hi"}]
BIG = 10**9  # far past MAX_TEMPLATE_CHARS: a check that only looked at the result would need a GB first

AMPLIFIERS = {
    "repeat": f"{{{{ 'x' * {BIG} }}}}",
    "repeat_reversed": f"{{{{ {BIG} * 'x' }}}}",
    "repeat_list": f"{{{{ [1] * {BIG} }}}}",
    "center_filter": f"{{{{ 'x'|center({BIG}) }}}}",
    "center_method": f"{{{{ 'x'.center({BIG}) }}}}",
    "ljust_method": f"{{{{ 'x'.ljust({BIG}) }}}}",
    "indent_filter": f"{{{{ 'a\\nb'|indent({BIG}) }}}}",
    "percent_format": f"{{{{ '%{BIG}d' % 1 }}}}",
    "format_filter": f"{{{{ '%{BIG}d'|format(1) }}}}",
    "str_format": f"{{{{ '{{:>{BIG}}}'.format(1) }}}}",
    "star_width": f"{{{{ '%*d' % ({BIG}, 1) }}}}",
    "star_precision": f"{{{{ '%.*f' % ({BIG}, 1.0) }}}}",
    "nested_format_width": f"{{{{ '{{0:{{1}}}}'.format(1, {BIG}) }}}}",
    "format_map_width": f"{{{{ '{{0:{{w}}}}'.format_map({{'w': {BIG}}}) }}}}",
    "join_filter": "{{ ('x' * 1000000)|join('y' * 100) }}",
    "join_method": "{{ ('y' * 100).join('x' * 1000000) }}",
    "replace_filter": "{{ ('x' * 1000000)|replace('x', 'y' * 100) }}",
    "power": "{{ 10 ** 100000000 }}",
    "namespace_doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}",
    "namespace_list_doubling": "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}"
                               "{% endfor %}",
    "macro_doubling": "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('x', 40) }}",
    "output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(AMPLIFIERS))
def test_amplifying_templates_fail_fast(name: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="limit"):
        render_template(compile_template(AMPLIFIERS[name]), messages=MESSAGES)
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize(
    "source",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% for i in 'x' * 100000 %}{% for j in 'y' * 100000 %}{% endfor %}{% endfor %}",
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    ],
    ids=["nested_range", "nested_strings", "macro_fan_out"],
)
def test_endless_templates_time_out(source: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="did not finish rendering in 0.3 s"):
        render_template(compile_template(source), timeout_s=0.3, messages=MESSAGES)
    assert time.perf_counter() - start < 2.0


def test_a_finished_render_is_never_interrupted_later() -> None:
    """The watchdog of a render that finished must not fire into the caller afterwards."""
    template = compile_template("{{ messages[0].content }}")
    outcomes = set()
    for _ in range(300):  # a deadline this short fires before, during or just after rendering
        try:
            outcomes.add(render_template(template, timeout_s=0.0005, messages=MESSAGES))
        except ChatTemplateError:
            outcomes.add("timeout")
    assert outcomes <= {"hi", "timeout"}
    deadline = time.perf_counter() + 0.1
    while time.perf_counter() < deadline:  # a stray pending exception would surface in these bytecodes
        pass


def test_the_timeout_never_lands_in_a_garbage_collectors_callback(monkeypatch) -> None:
    """The deadline's exception is raised in the rendering thread at whatever it runs: a garbage collection started
    by the render's allocations would run other code's weakref callbacks there, and the exception would end up in
    them (lost, their clean-up cut short) instead of in the render."""
    import gc
    import sys
    import weakref

    class Node:
        pass

    def slow_callback(_ref) -> None:
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass

    refs = []

    def garbage() -> str:  # other code's cyclic garbage, made while the template renders
        cycle = Node()
        cycle.self = cycle
        refs.append(weakref.ref(cycle, slow_callback))
        return ""

    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lost.append)
    template = compile_template("{% for i in range(50) %}{{ garbage() }}{% endfor %}")
    threshold = gc.get_threshold()
    gc.set_threshold(5)  # a collection every few allocations
    try:
        for _ in range(20):
            try:
                render_template(template, timeout_s=0.005, messages=MESSAGES, garbage=garbage)
            except ChatTemplateError:
                pass
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
    assert not lost, f"{len(lost)} timeouts landed in a weakref callback: {lost[0].exc_type}"


def test_template_errors_are_typed() -> None:
    with pytest.raises(ChatTemplateError, match="recursed too deeply"):
        render_template(compile_template("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"), messages=MESSAGES)
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        render_template(compile_template("{{ 1 / 0 }}"), messages=MESSAGES)
    with pytest.raises(ChatTemplateError, match="invalid Jinja"):
        compile_template("{% for %}")
    with pytest.raises(TemplateRaised, match="no system"):
        render_template(compile_template("{{ raise_exception('no system') }}"), messages=MESSAGES)
    assert issubclass(ChatTemplateError, ConfigError)


def test_ordinary_templates_render_unchanged() -> None:
    """The limits are invisible to real templates: loops, namespaces, filters and formatting as usual."""
    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "<|{{ m.role }}|>{{ m.content | trim | center(8) }}{{ '%03d' % ns.n }}{{ '{:>4}'.format(loop.index) }}"
        "{{ [m.role, m.content] | join(',') }}{{ m | tojson }}{% endfor %}{{ 'x' * 3 }}{{ 2 ** 10 }}"
        "{{ 'Cutoff 20231201, %s' % 'ok' }}{{ '{}'.format(10 ** 9) }}{{ '%*d|{0:{1}}' % (4, 2) }}"
    )
    messages = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "yo"}]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    plain.filters["tojson"] = _tojson
    expected = plain.from_string(source).render(messages=messages)  # the sandbox without kvcore's limits
    assert render_template(compile_template(source), messages=messages) == expected
    long = "y" * (MAX_TEMPLATE_CHARS // 2)  # big but legal
    rendered = render_template(compile_template("{{ messages[0].content }}"), messages=[{"content": long}])
    assert rendered == long
