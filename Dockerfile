# session-router: the router, the simulated workers and the bench in one slim image.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    SESSION_ROUTER_HOST=0.0.0.0 SESSION_ROUTER_PORT=8000

WORKDIR /app
COPY pyproject.toml README.md session_router_cli.py ./
COPY router ./router
COPY policies ./policies
COPY sim ./sim
COPY bench ./bench
RUN pip install . && useradd --create-home --uid 10001 router
USER router

EXPOSE 8000
# /health answers as soon as the process serves HTTP (the router and every sim worker have it)
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD python -c "import os,urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('HEALTHCHECK_PORT', os.environ['SESSION_ROUTER_PORT']), timeout=2)"

ENTRYPOINT ["session-router"]
CMD ["serve"]
