// Package build holds the checks of the packaging outside the Helm chart:
// the container image (the Dockerfile at the repository root) stays in sync
// with the Makefile and with what the node agent executes at run time, and
// the off-cluster install (docs/systemd: unit and config example,
// docs/off-cluster.md) works against a real API server. There is no Docker
// engine where this project is tested, so the image itself is not built by
// the tests; see dockerfile_test.go for what is checked instead.
package build
