# syntax=docker/dockerfile:1
#
# One image for both binaries of qemu-kubelet:
#   /usr/local/bin/qemu-kubelet            node agent (needs QEMU, below)
#   /usr/local/bin/exporterset-controller  ExporterSet controller (also
#                                          /exporter-set-controller)
# The Helm chart (charts/qemu-kubelet) runs each with an explicit command.
#
#   docker build -t qemu-kubelet:dev --build-arg VERSION=$(git describe --always) .
#
# Without a Docker engine, `make image` builds this image with buildah from a
# debootstrap base (hack/build-image.sh: the runtime stage below as written,
# the binaries from `make build`) and e2e's TestImage boots a VM through the
# agent running in it. build/dockerfile_test.go checks the build stage runs
# the same `make build` as the Makefile, the binaries copied are the ones
# `make build` writes, the runtime stage installs every Debian package the
# node agent executes at run time, and hack/build-image.sh builds this
# runtime stage.

# ---- build: the Makefile's own build, so the image and `make build` agree.
FROM golang:1.26-bookworm AS build
WORKDIR /src
ENV GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=v0.1.0-dev
RUN make build VERSION=${VERSION}

# ---- runtime: Debian with QEMU and the tools qemu/ runs.
FROM debian:bookworm-slim
# qemu-system-x86  the VMs (qemu-system-x86_64)
# qemu-system-arm  arm64 guests of guestArchitectures (qemu-system-aarch64)
# qemu-efi-aarch64 AAVMF: UEFI firmware for arm64 disk images
# qemu-utils       qemu-img: qcow2 overlays on cached base images, image info
# dosfstools       mkfs.vfat: the cloud-init/config disk
# mtools           mmd, mcopy: fill the config disk without mounting it
# ovmf             UEFI firmware for disk images that need it (optional per node)
# ca-certificates  TLS to OCI registries
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      qemu-system-x86 \
      qemu-system-arm \
      qemu-efi-aarch64 \
      qemu-utils \
      dosfstools \
      mtools \
      ovmf \
      ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# The controller runs as this non-root user (the image default). The node
# agent runs as root in the chart: it owns the host's state directory and,
# with a hostPath /dev/kvm, needs a privileged container anyway.
RUN groupadd --system --gid 65532 qemu-kubelet \
 && useradd --system --uid 65532 --gid 65532 --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin qemu-kubelet
COPY --from=build /src/bin/qemu-kubelet /src/bin/exporterset-controller /usr/local/bin/
# Jumpstarter's operator runs a provisioner's image as /exporter-set-controller
# (docs/jumpstarter-operator.md).
RUN ln -s /usr/local/bin/exporterset-controller /exporter-set-controller
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/exporterset-controller"]
