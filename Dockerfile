# session-router: the router and the simulated workers, in two stages. The build stage compiles
# the router's hot path with mypyc (router/native.py) where the package is installed; the
# runtime stage has neither compiler nor mypy, and no bench extra (matplotlib, rich).
FROM python:3.11.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md LICENSE session_router_cli.py ./
COPY router ./router
COPY policies ./policies
COPY sim ./sim
COPY bench ./bench
# compiled in /src (mypy reads the project's configuration there) into the installed package's
# .native, valid there because the installed sources are these sources
RUN pip install . && pip install --prefix=/install . \
    && pip install "mypy>=1.10" "setuptools>=68" wheel \
    && python -c "from pathlib import Path; from router import native; \
native.build(Path('/src'), Path('/install/lib/python3.11/site-packages/.native'))" \
    && cd /install/lib/python3.11/site-packages \
    && PYTHONPATH=. python -m session_router_cli native status

FROM python:3.11.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    SESSION_ROUTER_HOST=0.0.0.0 SESSION_ROUTER_PORT=8000
COPY --from=build /install /usr/local
COPY LICENSE /usr/share/doc/session-router/LICENSE
RUN useradd --create-home --uid 10001 router
USER router
WORKDIR /home/router

EXPOSE 8000
# /health answers as soon as the process serves HTTP (the router and every sim worker have it)
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD python -c "import os,urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('HEALTHCHECK_PORT', os.environ['SESSION_ROUTER_PORT']), timeout=2)"

ENTRYPOINT ["session-router"]
CMD ["serve"]
