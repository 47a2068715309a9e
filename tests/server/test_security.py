"""A GGUF whose chat template tries to reach Python internals cannot run code or read files
through the server: the chat request fails cleanly and the server keeps serving."""
from __future__ import annotations

import gguf
import httpx
import pytest

from tests.reference.tiny_gguf import write_tiny_llama
from tests.server.helpers import ServerProcess


def _hostile_gguf(path, template: str) -> None:
    class Writer(gguf.GGUFWriter):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.add_string("tokenizer.chat_template", template)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFWriter", Writer)
        write_tiny_llama(path, n_vocab=64, n_ctx=256)


def _templates(marker, secret) -> dict[str, str]:
    return {
        "os-via-globals": f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}",
        "subclasses": "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
                      f"{{{{ c(['touch', '{marker}']) }}}}{{% endif %}}{{% endfor %}}",
        "read-file-include": f"{{% include '{secret}' %}}",
        "attr-filter": f"{{{{ (messages|attr('__class__')).__init__.__globals__ }}}}{{{{ '{marker}' }}}}",
        "format-escape": "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
    }


@pytest.fixture(scope="module")
def secret(tmp_path_factory):
    p = tmp_path_factory.mktemp("secret") / "secret.txt"
    p.write_text("TOP-SECRET-CONTENT")
    return p


def test_hostile_template_over_http(tmp_path, secret):
    marker = tmp_path / "pwned"
    model = tmp_path / "hostile.gguf"
    _hostile_gguf(model, _templates(marker, secret)["os-via-globals"])
    with ServerProcess("-m", str(model), "--parallel", "2", "--ctx-size", "256") as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 4})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "chat template" in err["message"] and err["type"] == "invalid_request_error"
            assert not marker.exists()
            # the server still serves everything that does not need the template
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 0
            assert c.get("/health").json()["status"] == "ok"
        assert srv.alive()
    assert not marker.exists()


@pytest.mark.parametrize("name", ["os-via-globals", "subclasses", "read-file-include", "attr-filter",
                                  "format-escape"])
def test_hostile_templates_in_process(tmp_path, secret, name):
    from fastapi.testclient import TestClient

    from pyfast.server.app import create_app
    from pyfast.server.engine import Engine, EngineConfig

    marker = tmp_path / "pwned"
    model = tmp_path / f"{name}.gguf"
    _hostile_gguf(model, _templates(marker, secret)[name])
    try:
        engine = Engine(EngineConfig(model=str(model), n_parallel=1, n_ctx=128, n_threads=1))
    except ValueError:
        return  # refused at load time: also safe
    with TestClient(create_app(engine)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code in (400, 500), r.text
        assert "error" in r.json()
        assert "TOP-SECRET" not in r.text
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert not marker.exists()
