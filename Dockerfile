# syntax=docker/dockerfile:1
#
# quotad: a static binary on distroless, running as non-root.
#
#   docker build -t quotaring/quotad:dev .
#
# The Kubernetes manifests (deploy/kubernetes) expect this image; see
# deploy/README.md. The build command below is the one deploy/deploy_test.go
# runs locally (it cannot run docker here), so keep the two in step.

FROM golang:1.26 AS build
WORKDIR /src
# Modules first: they change less often than the code, so this layer caches.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod go mod download
COPY . .
# The version quotad version prints, each node logs and exports
# (quotaring_build_info) and records in the ledger: the context holds no .git
# for the go command to stamp, so pass it:
#   docker build --build-arg VERSION=$(git describe --tags --always --dirty) .
# Without it the image says "devel".
ARG VERSION=
# CGO_ENABLED=0: a static binary, the only kind distroless/static can run
# (the SQLite ledger is modernc.org/sqlite, pure Go, so nothing needs cgo).
RUN --mount=type=cache,target=/go/pkg/mod --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X github.com/quotaring/quotaring/internal/buildinfo.version=${VERSION}" -o /out/quotad ./cmd/quotad
# The data dir's mount point, owned by nonroot so that a volume mounted there
# without fsGroup (docker run -v) is still writable.
RUN mkdir -p /out/var/lib/quotad

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/quotad /usr/local/bin/quotad
COPY --from=build --chown=65532:65532 /out/var/lib/quotad /var/lib/quotad
# The node's log (Pebble) lives under the data dir and must survive restarts:
# it holds acknowledged charges not yet settled into the ledger. A subdirectory
# of the volume, so that a filesystem's lost+found at the volume root is not
# in Pebble's directory.
ENV QUOTAD_DATA_DIR=/var/lib/quotad/data
VOLUME ["/var/lib/quotad"]
# 8080 public HTTP (proxy), 7400 internal gRPC, 9090 admin (/healthz, /readyz,
# /metrics), 7946 gossip (memberlist, TCP and UDP).
EXPOSE 8080/tcp 7400/tcp 9090/tcp 7946/tcp 7946/udp
# nonroot is uid 65532 in distroless; numeric, so that Kubernetes'
# runAsNonRoot can verify it without reading /etc/passwd.
USER 65532:65532
# Ready (GET /readyz on the admin port, which quotad healthcheck finds from
# QUOTAD_ADMIN_ADDR): the image has no shell or HTTP client. A start replays
# the log and may migrate the ledger first: the start period covers it.
HEALTHCHECK --interval=10s --timeout=5s --start-period=5m --retries=3 CMD ["/usr/local/bin/quotad", "healthcheck"]
ENTRYPOINT ["/usr/local/bin/quotad"]
CMD ["serve"]
