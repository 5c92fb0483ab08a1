package oci

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"

	"github.com/containerd/containerd/v2/core/remotes/docker"
	remoteerrors "github.com/containerd/containerd/v2/core/remotes/errors"
	"github.com/containerd/errdefs"
)

// Error kinds. Every error returned by Pull wraps exactly one of them, so
// callers test with errors.Is and map them to ErrImagePull / ImagePullBackOff
// messages; the error text names the reference and what failed.
var (
	// ErrNotFound: the reference (tag, digest or repository) does not exist,
	// or (PullNever) the image is not in the cache.
	ErrNotFound = errors.New("image not found")
	// ErrUnauthorized: the registry refused the credentials (401/403) or
	// needs credentials that were not given.
	ErrUnauthorized = errors.New("unauthorized")
	// ErrRegistryUnavailable: 5xx answers, refused connections, timeouts.
	// Worth retrying with backoff.
	ErrRegistryUnavailable = errors.New("registry unavailable")
	// ErrUnsupportedArtifact: the manifest is neither a containerDisk nor an
	// OS image file artifact; the message names the media types found.
	ErrUnsupportedArtifact = errors.New("unsupported artifact")
	// ErrHostileContent: a layer tries to escape the cache (absolute paths,
	// "..", links pointing outside) or is otherwise malformed.
	ErrHostileContent = errors.New("hostile content")
	// ErrTooLarge: a manifest, layer or unpacked file exceeds a size limit.
	ErrTooLarge = errors.New("content too large")
	// ErrDigestMismatch: downloaded bytes do not match their descriptor.
	ErrDigestMismatch = errors.New("digest mismatch")
	// ErrInvalidReference: the reference cannot be parsed.
	ErrInvalidReference = errors.New("invalid image reference")
)

// PullError is the error returned by Pull. Kind is one of the Err* values
// above; Err is the underlying cause.
type PullError struct {
	Ref  string
	Kind error
	Err  error
}

func (e *PullError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("pull %s: %v", e.Ref, e.Kind)
	}
	return fmt.Sprintf("pull %s: %v: %v", e.Ref, e.Kind, e.Err)
}

// Unwrap exposes both the kind and the cause to errors.Is / errors.As.
func (e *PullError) Unwrap() []error { return []error{e.Kind, e.Err} }

// kindError tags err with a kind inside the package; pullError turns it into
// a *PullError at the API boundary.
type kindError struct {
	kind error
	err  error
}

func (e *kindError) Error() string   { return e.err.Error() }
func (e *kindError) Unwrap() []error { return []error{e.kind, e.err} }

func withKind(kind error, format string, args ...any) error {
	return &kindError{kind: kind, err: fmt.Errorf(format, args...)}
}

// classify maps an error from the containerd remotes/content libraries (or
// our own) to one of the kinds above.
func classify(err error) error {
	var ke *kindError
	if errors.As(err, &ke) {
		return ke.kind
	}
	for _, k := range []error{ErrNotFound, ErrUnauthorized, ErrRegistryUnavailable, ErrUnsupportedArtifact,
		ErrHostileContent, ErrTooLarge, ErrDigestMismatch, ErrInvalidReference} {
		if errors.Is(err, k) {
			return k
		}
	}
	var us remoteerrors.ErrUnexpectedStatus
	if errors.As(err, &us) {
		switch {
		case us.StatusCode == http.StatusUnauthorized || us.StatusCode == http.StatusForbidden:
			return ErrUnauthorized
		case us.StatusCode == http.StatusNotFound:
			return ErrNotFound
		case us.StatusCode == http.StatusTooManyRequests || us.StatusCode >= 500:
			return ErrRegistryUnavailable
		}
	}
	switch {
	case errors.Is(err, docker.ErrInvalidAuthorization):
		return ErrUnauthorized
	case errdefs.IsNotFound(err):
		return ErrNotFound
	case errdefs.IsFailedPrecondition(err) && strings.Contains(err.Error(), "unexpected commit"):
		return ErrDigestMismatch
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded),
		errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET),
		errdefs.IsUnavailable(err):
		return ErrRegistryUnavailable
	}
	var ne net.Error
	if errors.As(err, &ne) {
		return ErrRegistryUnavailable
	}
	var oe *net.OpError
	if errors.As(err, &oe) {
		return ErrRegistryUnavailable
	}
	if strings.Contains(err.Error(), "unexpected EOF") || strings.Contains(err.Error(), "short read") {
		return ErrRegistryUnavailable
	}
	return ErrRegistryUnavailable
}

func pullError(ref string, err error) error {
	if err == nil {
		return nil
	}
	var pe *PullError
	if errors.As(err, &pe) {
		return err
	}
	if errors.Is(err, context.Canceled) {
		return fmt.Errorf("pull %s: %w", ref, err)
	}
	return &PullError{Ref: ref, Kind: classify(err), Err: err}
}
