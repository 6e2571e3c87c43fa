# shoal's image: every role (chief, ps, worker) and the examples, on a CPU base.
#   docker build -t shoal:latest .
# torch comes from PyTorch's CPU index (the +cpu build of the version constraints.txt pins, about
# 200 MB instead of several GB of CUDA libraries); every other package at its constraints.txt pin.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

COPY constraints.txt ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==$(sed -n 's/^torch==//p' constraints.txt)"

COPY pyproject.toml README.md ./
COPY shoal shoal
COPY cli cli
COPY chief chief
COPY ps ps
COPY worker worker
COPY proto proto
COPY examples examples
RUN pip install -c constraints.txt ".[examples]" \
    && useradd --create-home --uid 10001 shoal \
    && mkdir -p /state && chown shoal /state

# the digits example caches its data split here; the state volume holds the journal and checkpoints
ENV XDG_CACHE_HOME=/tmp/cache
USER shoal
EXPOSE 7070 7071
ENTRYPOINT ["shoal"]
CMD ["--help"]
