package oci

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/core/remotes"
	"github.com/containerd/containerd/v2/core/remotes/docker"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/semaphore"
)

// PullPolicy mirrors a container's imagePullPolicy.
type PullPolicy string

const (
	// PullIfNotPresent uses a cached image for the same reference name
	// without contacting the registry (the default).
	PullIfNotPresent PullPolicy = "IfNotPresent"
	// PullAlways resolves the reference at the registry; content already
	// cached under the resolved digest is not downloaded again.
	PullAlways PullPolicy = "Always"
	// PullNever only uses the cache; a missing image is ErrNotFound.
	PullNever PullPolicy = "Never"
)

// PullOptions are per-pull settings.
type PullOptions struct {
	// Auth holds Docker config JSON documents, e.g. the .dockerconfigjson
	// values of a pod's imagePullSecrets; later ones win per registry.
	Auth [][]byte
	// Credentials, when set, log in to the reference's own registry with
	// this user and password for this pull (over Auth for that registry;
	// e.g. a Jumpstarter flash_oci call's). Never logged.
	Credentials *Credentials
	// Policy (default PullIfNotPresent).
	Policy PullPolicy
	// Progress, if set, is called with byte counts while downloading (at
	// most every 100ms, and once at the end).
	Progress func(Progress)
	// ProveAccess: before a cached (or in-flight) copy is used, the
	// reference's registry must hand this pull the manifest's bytes by
	// digest, with these credentials, and they must hash to that digest
	// (proveAccess). A registry that merely names a digest the node has
	// cached (its own, or another registry's private one), or that refuses
	// these credentials, gets nothing from the cache.
	ProveAccess bool
	// Dial, when set, makes every connection of this pull to the
	// reference's registry, its token service and its redirects (not the
	// node's configured mirrors of it) on a transport of the pull's own,
	// so it can refuse an address at dial time (e.g. a lease's fetch
	// policy). Connections are not shared with other pulls.
	Dial Dialer
}

// Dialer makes a pull's connections (PullOptions.Dial): net.Dialer's
// DialContext, or one that refuses some addresses.
type Dialer interface {
	DialContext(ctx context.Context, network, addr string) (net.Conn, error)
}

// Credentials are a registry user name and password. String hides the
// password.
type Credentials struct {
	Username string
	Password string
}

func (c Credentials) String() string { return "{Username:" + c.Username + " Password:<redacted>}" }

// GoString hides the password from %#v.
func (c Credentials) GoString() string { return c.String() }

// Progress of one pull.
type Progress struct {
	Ref   string
	Done  int64 // bytes downloaded (including bytes resumed from an earlier attempt)
	Total int64 // bytes to download (0 until the manifest is known)
}

// Pull returns the cached image for ref, downloading, verifying and
// unpacking it first if needed. Concurrent pulls of the same digest share
// one download. Errors are *PullError (errors.Is with ErrNotFound,
// ErrUnauthorized, ...), or wrap context.Canceled.
func (s *Store) Pull(ctx context.Context, ref string, opts PullOptions) (*Image, error) {
	img, err := s.pull(ctx, ref, opts)
	return img, pullError(ref, err)
}

func (s *Store) pull(ctx context.Context, ref string, opts PullOptions) (*Image, error) {
	named, err := reference.ParseDockerRef(ref)
	if err != nil {
		return nil, withKind(ErrInvalidReference, "%w", err)
	}
	name := named.String()
	if opts.Policy == "" {
		opts.Policy = PullIfNotPresent
	}
	if opts.Policy != PullAlways {
		if img := s.lookup(name, named); img != nil {
			return img, nil
		}
		if opts.Policy == PullNever {
			return nil, withKind(ErrNotFound, "not in the cache and pull policy is Never")
		}
	}
	auth, err := parseDockerConfig(opts.Auth...)
	if err != nil {
		return nil, withKind(ErrUnauthorized, "%w", err)
	}
	if c := opts.Credentials; c != nil {
		auth.Auths[normalizeAuthKey(reference.Domain(named))] = dockerAuth{Username: c.Username, Password: c.Password}
	}
	own := s.clients
	if opts.Dial != nil {
		own = s.opts.dialClients(opts.Dial)
		defer own.closeIdle()
	}
	resolver := docker.NewResolver(docker.ResolverOptions{Hosts: s.opts.registryHosts(s.clients, own, auth)})
	rctx, cancel := context.WithTimeout(ctx, s.opts.ResponseHeaderTimeout+s.opts.DialTimeout)
	_, desc, err := resolver.Resolve(rctx, name)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("resolve: %w", err)
	}
	if opts.ProveAccess {
		if err := s.proveAccess(ctx, resolver, name, desc); err != nil {
			return nil, err
		}
	}
	for {
		s.mu.Lock()
		if e, ok := s.entries[desc.Digest]; ok {
			s.names[name] = desc.Digest
			names := s.namesSnapshot()
			s.touch(e)
			img := s.image(name, e)
			s.mu.Unlock()
			return img, s.saveNames(names)
		}
		if f, ok := s.inflight[desc.Digest]; ok {
			s.mu.Unlock()
			select {
			case <-f.done:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			if f.err != nil && errors.Is(f.err, context.Canceled) && ctx.Err() == nil {
				continue // the leader gave up; take over
			}
			if f.err != nil {
				return nil, f.err
			}
			continue // committed: record our name via the cached path
		}
		f := &flight{done: make(chan struct{})}
		s.inflight[desc.Digest] = f
		s.mu.Unlock()

		f.img, f.err = s.fetchAndUnpack(ctx, resolver, name, desc, opts.Progress)
		s.mu.Lock()
		delete(s.inflight, desc.Digest)
		if f.err == nil {
			s.names[name] = desc.Digest
		}
		names := s.namesSnapshot()
		s.mu.Unlock()
		close(f.done)
		if f.err != nil {
			return nil, f.err
		}
		return f.img, s.saveNames(names)
	}
}

// lookup finds a cached image by name (or by digest for digest references).
func (s *Store) lookup(name string, named reference.Named) *Image {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, ok := s.names[name]
	if !ok {
		if c, isDigest := named.(reference.Canonical); isDigest {
			d, ok = c.Digest(), true
		}
	}
	if !ok {
		return nil
	}
	e, ok := s.entries[d]
	if !ok {
		return nil
	}
	if _, known := s.names[name]; !known {
		s.names[name] = d
	}
	s.touch(e)
	return s.image(name, e)
}

// fetchAndUnpack downloads and verifies the image behind desc and commits a
// cache entry for it.
func (s *Store) fetchAndUnpack(ctx context.Context, resolver remotes.Resolver, name string, desc ocispec.Descriptor, progress func(Progress)) (*Image, error) {
	log := s.log.WithValues("ref", name, "digest", desc.Digest)
	start := time.Now()
	fetcher, err := resolver.Fetcher(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("fetcher: %w", err)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	pr := &pullProgress{ref: name, fn: progress, last: time.Now()}
	stop := s.watchStall(ctx, cancel, pr)
	defer stop()
	ing := &countingIngester{Ingester: s.content, p: pr}
	fetch := func(descs ...ocispec.Descriptor) error {
		err := images.Dispatch(ctx, remotes.FetchHandler(ing, fetcher), semaphore.NewWeighted(int64(s.opts.Concurrency)), descs...)
		if err != nil {
			if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
				err = cause
			}
			if classify(err) == ErrDigestMismatch {
				for _, d := range descs { // a bad ingest must not be resumed
					_ = s.content.Abort(context.WithoutCancel(ctx), remotes.MakeRefKey(ctx, d))
				}
			}
		}
		return err
	}

	// Manifests (index and platform manifest) stay busy until the entry
	// that lists them is committed; layers while they are unpacked.
	var manifests []ocispec.Descriptor
	defer func() { s.markBusy(manifests, -1) }()
	fetchManifestBlob := func(descs ...ocispec.Descriptor) error {
		s.markBusy(descs, +1)
		manifests = append(manifests, descs...)
		return fetch(descs...)
	}
	manifestDesc, m, err := s.fetchManifest(ctx, fetchManifestBlob, desc, pr, 0)
	if err != nil {
		return nil, err
	}
	p, err := planManifest(m)
	if err != nil {
		return nil, err
	}
	if err := s.checkSizes(p); err != nil {
		return nil, err
	}
	var layers []ocispec.Descriptor
	var total int64
	for _, l := range m.Layers {
		layers = append(layers, l)
		total += l.Size
	}
	pr.addTotal(total)
	s.markBusy(layers, +1)
	defer func() { s.releaseBlobs(ctx, layers) }()
	if err := fetch(layers...); err != nil {
		return nil, fmt.Errorf("fetch layers: %w", err)
	}
	pr.report(true)

	tmp, err := os.MkdirTemp(filepath.Join(s.root, "tmp"), entryDirName(desc.Digest)+"-")
	if err != nil {
		return nil, fmt.Errorf("create entry: %w", err)
	}
	defer func() { _ = removeAll(tmp) }()
	if err := os.Chmod(tmp, entryMode); err != nil { // MkdirTemp makes it 0700
		return nil, fmt.Errorf("create entry: %w", err)
	}
	meta := entryMeta{
		Digest: desc.Digest, ManifestDigest: manifestDesc.Digest, Platform: s.opts.Platform,
		Format: p.Format, PulledAt: time.Now().UTC(), Blobs: dedupDigests(desc.Digest, manifestDesc.Digest),
	}
	if err := s.unpack(ctx, p, tmp, &meta); err != nil {
		return nil, err
	}
	mb, err := json.MarshalIndent(meta, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := writeFileAtomic(filepath.Join(tmp, "meta.json"), mb); err != nil {
		return nil, err
	}
	if err := syncDir(tmp); err != nil {
		return nil, err
	}
	dst := s.entryDir(desc.Digest)
	if err := os.Rename(tmp, dst); err != nil {
		return nil, fmt.Errorf("commit entry %s: %w", dst, err)
	}
	_ = syncDir(filepath.Dir(dst))
	s.mu.Lock()
	e := &entry{meta: meta, lastUsed: time.Now()}
	s.entries[desc.Digest] = e
	img := s.image(name, e)
	s.mu.Unlock()
	log.Info("pulled image", "format", meta.Format, "size", meta.Size, "downloaded", pr.done.Load(), "duration", time.Since(start))
	return img, nil
}

// fetchManifest fetches desc (index or manifest) and returns the platform
// manifest.
func (s *Store) fetchManifest(ctx context.Context, fetch func(...ocispec.Descriptor) error, desc ocispec.Descriptor, pr *pullProgress, depth int) (ocispec.Descriptor, ocispec.Manifest, error) {
	var m ocispec.Manifest
	if depth > 2 {
		return desc, m, withKind(ErrUnsupportedArtifact, "index nesting deeper than 2")
	}
	if desc.Size > s.opts.Limits.MaxManifestBytes {
		return desc, m, withKind(ErrTooLarge, "manifest %s is %d bytes, limit %d", desc.Digest, desc.Size, s.opts.Limits.MaxManifestBytes)
	}
	if !images.IsManifestType(desc.MediaType) && !images.IsIndexType(desc.MediaType) {
		return desc, m, withKind(ErrUnsupportedArtifact, "%s is %q, not an image manifest or index", desc.Digest, desc.MediaType)
	}
	pr.addTotal(desc.Size)
	if err := fetch(desc); err != nil {
		return desc, m, fmt.Errorf("fetch manifest %s: %w", desc.Digest, err)
	}
	b, err := content.ReadBlob(ctx, s.content, desc)
	if err != nil {
		return desc, m, fmt.Errorf("read manifest %s: %w", desc.Digest, err)
	}
	if images.IsIndexType(desc.MediaType) {
		var idx ocispec.Index
		if err := json.Unmarshal(b, &idx); err != nil {
			return desc, m, withKind(ErrHostileContent, "index %s: %w", desc.Digest, err)
		}
		child, err := selectPlatform(idx, s.platform, s.opts.Platform)
		if err != nil {
			return desc, m, err
		}
		return s.fetchManifest(ctx, fetch, child, pr, depth+1)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return desc, m, withKind(ErrHostileContent, "manifest %s: %w", desc.Digest, err)
	}
	return desc, m, nil
}

// selectPlatform picks the best manifest of idx for the platform.
func selectPlatform(idx ocispec.Index, mc platforms.MatchComparer, want string) (ocispec.Descriptor, error) {
	var cands, unlabeled []ocispec.Descriptor
	var seen []string
	for _, d := range idx.Manifests {
		if d.Platform == nil {
			unlabeled = append(unlabeled, d)
			continue
		}
		seen = append(seen, platforms.Format(*d.Platform))
		if mc.Match(*d.Platform) {
			cands = append(cands, d)
		}
	}
	if len(cands) == 0 && len(idx.Manifests) == 1 && len(unlabeled) == 1 {
		return unlabeled[0], nil
	}
	if len(cands) == 0 {
		return ocispec.Descriptor{}, withKind(ErrUnsupportedArtifact, "no manifest for platform %s in the index (it has: %s)", want, strings.Join(seen, ", "))
	}
	sort.SliceStable(cands, func(i, j int) bool { return mc.Less(*cands[i].Platform, *cands[j].Platform) })
	return cands[0], nil
}

func (s *Store) checkSizes(p plan) error {
	lim := s.opts.Limits
	for _, l := range p.Layers {
		if l.Size > lim.MaxBlobBytes {
			return withKind(ErrTooLarge, "layer %s is %d bytes, limit %d", describe(l), l.Size, lim.MaxBlobBytes)
		}
	}
	for role, f := range p.Files {
		max := lim.MaxSmallBytes
		if role == RoleDisk {
			max = lim.MaxBlobBytes
		}
		if f.Layer.Size > max {
			return withKind(ErrTooLarge, "%s layer %s is %d bytes, limit %d", role, describe(f.Layer), f.Layer.Size, max)
		}
	}
	return nil
}

// unpack writes the entry's files into dir and fills meta.
func (s *Store) unpack(ctx context.Context, p plan, dir string, meta *entryMeta) error {
	lim := s.opts.Limits
	switch p.Format {
	case FormatContainerDisk:
		dst := filepath.Join(dir, "disk")
		var disk tarDisk
		for _, l := range p.Layers {
			d, found, err := s.withBlob(ctx, l, func(r io.Reader) (tarDisk, bool, error) {
				zr, done, err := decompress(r, tarCompression(l.MediaType))
				if err != nil {
					return tarDisk{}, false, err
				}
				defer done()
				return extractContainerDisk(zr, dst, lim.MaxFileBytes)
			})
			if err != nil {
				return fmt.Errorf("layer %s: %w", l.Digest, err)
			}
			if found {
				if disk.Name != "" && disk.Name != d.Name {
					return withKind(ErrUnsupportedArtifact, "containerDisk holds two disk files: %s and %s", disk.Name, d.Name)
				}
				disk = d
			}
		}
		if disk.Name == "" {
			return withKind(ErrUnsupportedArtifact, "containerDisk has no file under disk/ in its %d layer(s)", len(p.Layers))
		}
		return s.finishDisk(dir, meta)
	case FormatFiles:
		for _, role := range []Role{RoleKernel, RoleInitrd, RoleDisk, RoleCmdline} {
			f, ok := p.Files[role]
			if !ok {
				continue
			}
			limit := lim.MaxSmallBytes
			if role == RoleDisk {
				limit = lim.MaxFileBytes
			}
			dst := filepath.Join(dir, string(role))
			if role == RoleCmdline {
				dst = filepath.Join(dir, ".cmdline")
				limit = 4096
			}
			if err := s.materialize(ctx, f, dst, limit); err != nil {
				return fmt.Errorf("%s %s: %w", role, describe(f.Layer), err)
			}
			switch role {
			case RoleKernel:
				meta.Kernel = "kernel"
			case RoleInitrd:
				meta.Initrd = "initrd"
			case RoleCmdline:
				b, err := os.ReadFile(dst)
				if err != nil {
					return err
				}
				_ = os.Remove(dst)
				cmd := strings.TrimSpace(string(b))
				if strings.ContainsAny(cmd, "\x00\n\r") {
					return withKind(ErrHostileContent, "cmdline has control characters")
				}
				meta.Cmdline = cmd
			case RoleDisk:
				if err := s.finishDisk(dir, meta); err != nil {
					return err
				}
			}
		}
		for _, f := range []string{meta.Kernel, meta.Initrd, meta.Disk} {
			if f == "" {
				continue
			}
			fi, err := os.Stat(filepath.Join(dir, f))
			if err != nil {
				return err
			}
			meta.Size += fi.Size()
		}
		return nil
	}
	return fmt.Errorf("unknown format %q", p.Format)
}

// finishDisk names dir/disk by its sniffed format and records it.
func (s *Store) finishDisk(dir string, meta *entryMeta) error {
	src := filepath.Join(dir, "disk")
	format, err := diskFormat(src)
	if err != nil {
		return fmt.Errorf("disk: %w", err)
	}
	name := "disk." + format
	if err := os.Rename(src, filepath.Join(dir, name)); err != nil {
		return err
	}
	meta.Disk, meta.DiskFormat = name, format
	if meta.Format == FormatContainerDisk {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		meta.Size = fi.Size()
	}
	return nil
}

// materialize puts one file layer at dst: a hard link to the verified blob
// when uncompressed (no copy), else the decompressed bytes.
func (s *Store) materialize(ctx context.Context, f planFile, dst string, limit int64) error {
	if f.Compression == CompressionNone {
		if f.Layer.Size > limit {
			return withKind(ErrTooLarge, "%d bytes, limit %d", f.Layer.Size, limit)
		}
		blob := s.blobPath(f.Layer.Digest)
		if err := os.Link(blob, dst); err == nil {
			return nil
		}
	}
	_, _, err := s.withBlob(ctx, f.Layer, func(r io.Reader) (tarDisk, bool, error) {
		zr, done, err := decompress(r, f.Compression)
		if err != nil {
			return tarDisk{}, false, err
		}
		defer done()
		_, err = writeLimited(dst, zr, limit)
		return tarDisk{}, false, err
	})
	return err
}

func (s *Store) blobPath(d digest.Digest) string {
	return filepath.Join(s.root, "content", "blobs", d.Algorithm().String(), d.Encoded())
}

func (s *Store) withBlob(ctx context.Context, l ocispec.Descriptor, fn func(io.Reader) (tarDisk, bool, error)) (tarDisk, bool, error) {
	ra, err := s.content.ReaderAt(ctx, l)
	if err != nil {
		return tarDisk{}, false, fmt.Errorf("open blob %s: %w", l.Digest, err)
	}
	defer ra.Close()
	return fn(io.NewSectionReader(ra, 0, ra.Size()))
}

func (s *Store) markBusy(descs []ocispec.Descriptor, delta int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range descs {
		s.busyBlobs[d.Digest] += delta
		if s.busyBlobs[d.Digest] <= 0 {
			delete(s.busyBlobs, d.Digest)
		}
	}
}

// releaseBlobs drops layer blobs no other pull needs: entries hold their own
// files (hard links or unpacked copies), so the blobs are only staging.
func (s *Store) releaseBlobs(ctx context.Context, descs []ocispec.Descriptor) {
	s.markBusy(descs, -1)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range descs {
		if s.busyBlobs[d.Digest] == 0 {
			if err := s.content.Delete(context.WithoutCancel(ctx), d.Digest); err != nil && !errdefs.IsNotFound(err) {
				s.log.Info("cannot drop staged blob", "digest", d.Digest, "err", err)
			}
		}
	}
}

func dedupDigests(ds ...digest.Digest) []digest.Digest {
	var out []digest.Digest
	for i, d := range ds {
		if i == 0 || d != ds[i-1] {
			out = append(out, d)
		}
	}
	return out
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// watchStall cancels ctx when no byte arrived for StallTimeout.
func (s *Store) watchStall(ctx context.Context, cancel context.CancelCauseFunc, pr *pullProgress) func() {
	done := make(chan struct{})
	every := s.opts.StallTimeout / 4
	go func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
				if since := time.Since(time.Unix(0, pr.lastNano.Load())); since > s.opts.StallTimeout && pr.lastNano.Load() != 0 {
					cancel(withKind(ErrRegistryUnavailable, "no data received for %s", since.Round(time.Second)))
					return
				}
			}
		}
	}()
	pr.lastNano.Store(time.Now().UnixNano())
	return func() { close(done) }
}

// pullProgress aggregates byte counts of one pull.
type pullProgress struct {
	ref      string
	fn       func(Progress)
	done     atomic.Int64
	total    atomic.Int64
	lastNano atomic.Int64
	mu       sync.Mutex
	last     time.Time
}

func (p *pullProgress) addTotal(n int64) { p.total.Add(n) }

func (p *pullProgress) add(n int64) {
	p.done.Add(n)
	p.lastNano.Store(time.Now().UnixNano())
	p.report(false)
}

func (p *pullProgress) report(final bool) {
	if p.fn == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if !final && time.Since(p.last) < 100*time.Millisecond {
		return
	}
	p.last = time.Now()
	p.fn(Progress{Ref: p.ref, Done: p.done.Load(), Total: p.total.Load()})
}

// countingIngester wraps the content store's ingest to count bytes and to
// refuse more bytes than a descriptor declares.
type countingIngester struct {
	content.Ingester
	p *pullProgress
}

func (c *countingIngester) Writer(ctx context.Context, opts ...content.WriterOpt) (content.Writer, error) {
	var wo content.WriterOpts
	for _, o := range opts {
		if err := o(&wo); err != nil {
			return nil, err
		}
	}
	w, err := c.Ingester.Writer(ctx, opts...)
	if errdefs.IsAlreadyExists(err) {
		c.p.add(wo.Desc.Size) // verified earlier: done without downloading
	}
	if err != nil {
		return nil, err
	}
	st, err := w.Status()
	if err != nil {
		w.Close()
		return nil, err
	}
	c.p.add(st.Offset) // resumed bytes count as done
	return &countingWriter{Writer: w, desc: wo.Desc, written: st.Offset, p: c.p}, nil
}

type countingWriter struct {
	content.Writer
	desc    ocispec.Descriptor
	written int64
	p       *pullProgress
}

func (w *countingWriter) Write(b []byte) (int, error) {
	if w.desc.Size > 0 && w.written+int64(len(b)) > w.desc.Size {
		return 0, withKind(ErrDigestMismatch, "registry sent more than the %d bytes of %s", w.desc.Size, w.desc.Digest)
	}
	n, err := w.Writer.Write(b)
	w.written += int64(n)
	w.p.add(int64(n))
	return n, err
}

func (w *countingWriter) Truncate(size int64) error {
	w.p.add(size - w.written)
	w.written = size
	return w.Writer.Truncate(size)
}
