package oci

import (
	"context"
	"fmt"
	"io"

	"github.com/containerd/containerd/v2/core/remotes"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// proveAccess is PullOptions.ProveAccess: the registry of name, asked with
// this pull's credentials (resolver), must hand over the bytes of the
// manifest desc by digest, and they must hash to desc.Digest. Resolving a
// tag (or a HEAD of a digest) is not enough: any registry can answer a
// HEAD with a digest it does not hold, and a registry that holds the
// manifest proves the caller may read it. Only then may the node's cached
// copy of desc (or a pull of it in flight) be used for this pull.
func (s *Store) proveAccess(ctx context.Context, resolver remotes.Resolver, name string, desc ocispec.Descriptor) error {
	if desc.Size > s.opts.Limits.MaxManifestBytes {
		return withKind(ErrTooLarge, "manifest %s is %d bytes, limit %d", desc.Digest, desc.Size, s.opts.Limits.MaxManifestBytes)
	}
	if err := desc.Digest.Validate(); err != nil {
		return withKind(ErrHostileContent, "the registry named manifest digest %q: %w", desc.Digest, err)
	}
	ctx, cancel := context.WithTimeout(ctx, s.opts.ResponseHeaderTimeout+s.opts.DialTimeout)
	defer cancel()
	fetcher, err := resolver.Fetcher(ctx, name)
	if err != nil {
		return fmt.Errorf("fetcher: %w", err)
	}
	rc, err := fetcher.Fetch(ctx, desc)
	if err != nil {
		return fmt.Errorf("fetch manifest %s to prove access: %w", desc.Digest, err)
	}
	defer rc.Close()
	v := desc.Digest.Verifier()
	n, err := io.Copy(v, io.LimitReader(rc, desc.Size+1))
	if err != nil {
		return fmt.Errorf("fetch manifest %s to prove access: %w", desc.Digest, err)
	}
	if n != desc.Size || !v.Verified() {
		return withKind(ErrDigestMismatch, "the registry named manifest %s (%d bytes) but served %d bytes that do not hash to it: nothing is served from the node's cache for it", desc.Digest, desc.Size, n)
	}
	return nil
}
