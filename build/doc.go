// Package build holds the checks that keep the container image (the
// Dockerfile at the repository root) in sync with the Makefile and with what
// the node agent executes at run time. There is no Docker engine where this
// project is tested, so the image itself is not built by the tests; see
// dockerfile_test.go for what is checked instead.
package build
