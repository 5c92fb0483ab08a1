package oci

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/containerd/v2/core/content"
	"github.com/containerd/containerd/v2/plugins/content/local"
	"github.com/containerd/errdefs"
	"github.com/containerd/platforms"
	"github.com/go-logr/logr"
	"github.com/opencontainers/go-digest"
)

// Store is the host-wide, content-addressed cache of pulled OS images.
//
// Layout under the root directory:
//
//	.lock                    flock held by the one process using the store
//	content/                 containerd local content store: verified blobs and
//	                         resumable ingests (partial downloads)
//	images/sha256-<hex>/     one committed entry per image digest: meta.json plus
//	                         the files (kernel, initrd, disk.qcow2|disk.raw)
//	tmp/                     entries being built; renamed into images/ atomically
//	names.json               reference name -> image digest
//
// An entry is visible only after its directory was renamed into images/ with a
// complete meta.json, so a crash never leaves a half-written entry in use; Open
// deletes tmp/ leftovers and entries without valid metadata.
type Store struct {
	root     string
	opts     Options
	content  content.Store
	lock     *os.File
	platform platforms.MatchComparer
	log      logr.Logger
	clients  clients

	mu        sync.Mutex
	entries   map[digest.Digest]*entry
	names     map[string]digest.Digest
	inflight  map[digest.Digest]*flight
	busyBlobs map[digest.Digest]int
	closed    bool
}

type entry struct {
	meta     entryMeta
	refs     int
	lastUsed time.Time
}

// entryMeta is meta.json of a committed entry.
type entryMeta struct {
	Digest         digest.Digest   `json:"digest"`
	ManifestDigest digest.Digest   `json:"manifestDigest"`
	Platform       string          `json:"platform,omitempty"`
	Format         Format          `json:"format"`
	Kernel         string          `json:"kernel,omitempty"`
	Initrd         string          `json:"initrd,omitempty"`
	Disk           string          `json:"disk,omitempty"`
	DiskFormat     string          `json:"diskFormat,omitempty"`
	Cmdline        string          `json:"cmdline,omitempty"`
	Size           int64           `json:"size"`
	PulledAt       time.Time       `json:"pulledAt"`
	Blobs          []digest.Digest `json:"blobs"` // manifests kept in content/
}

type flight struct {
	done chan struct{}
	img  *Image
	err  error
}

// Open opens (creating if needed) the store rooted at root. Only one process
// may use a root at a time.
func Open(root string, opts Options) (*Store, error) {
	opts = opts.withDefaults()
	p, err := platforms.Parse(opts.Platform)
	if err != nil {
		return nil, fmt.Errorf("open image store: platform %q: %w", opts.Platform, err)
	}
	for _, d := range []string{"content", "images", "tmp"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return nil, fmt.Errorf("open image store %s: %w", root, err)
		}
	}
	lock, err := os.OpenFile(filepath.Join(root, ".lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open image store %s: %w", root, err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lock.Close()
		return nil, fmt.Errorf("open image store %s: in use by another process: %w", root, err)
	}
	cs, err := local.NewStore(filepath.Join(root, "content"))
	if err != nil {
		lock.Close()
		return nil, fmt.Errorf("open image store %s: content store: %w", root, err)
	}
	s := &Store{
		root:      root,
		opts:      opts,
		content:   cs,
		lock:      lock,
		platform:  platforms.Only(p),
		log:       opts.Logger.WithName("oci"),
		clients:   opts.newClients(),
		entries:   map[digest.Digest]*entry{},
		names:     map[string]digest.Digest{},
		inflight:  map[digest.Digest]*flight{},
		busyBlobs: map[digest.Digest]int{},
	}
	if err := s.load(); err != nil {
		lock.Close()
		return nil, err
	}
	return s, nil
}

// load reads committed entries and names, dropping anything half-written.
func (s *Store) load() error {
	tmp := filepath.Join(s.root, "tmp")
	leftovers, _ := os.ReadDir(tmp)
	for _, l := range leftovers {
		s.log.Info("removing unfinished image entry", "path", filepath.Join(tmp, l.Name()))
		if err := removeAll(filepath.Join(tmp, l.Name())); err != nil {
			return fmt.Errorf("open image store: clean %s: %w", tmp, err)
		}
	}
	dirs, err := os.ReadDir(filepath.Join(s.root, "images"))
	if err != nil {
		return fmt.Errorf("open image store: %w", err)
	}
	for _, d := range dirs {
		dir := filepath.Join(s.root, "images", d.Name())
		m, used, err := readMeta(dir)
		if err != nil || entryDirName(m.Digest) != d.Name() || !m.filesPresent(dir) {
			s.log.Info("removing invalid image entry", "path", dir, "err", err)
			if err := removeAll(dir); err != nil {
				return fmt.Errorf("open image store: remove invalid entry %s: %w", dir, err)
			}
			continue
		}
		// Entries unpacked before entry dirs were made 0755 (entryMode).
		if err := os.Chmod(dir, entryMode); err != nil {
			return fmt.Errorf("open image store: %w", err)
		}
		s.entries[m.Digest] = &entry{meta: m, lastUsed: used}
	}
	b, err := os.ReadFile(filepath.Join(s.root, "names.json"))
	if err == nil {
		var names map[string]digest.Digest
		if err := json.Unmarshal(b, &names); err != nil {
			s.log.Info("ignoring unreadable names.json", "err", err)
		}
		for n, d := range names {
			if _, ok := s.entries[d]; ok {
				s.names[n] = d
			}
		}
	}
	return nil
}

func readMeta(dir string) (entryMeta, time.Time, error) {
	var m entryMeta
	p := filepath.Join(dir, "meta.json")
	b, err := os.ReadFile(p)
	if err != nil {
		return m, time.Time{}, err
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, time.Time{}, fmt.Errorf("%s: %w", p, err)
	}
	if err := m.Digest.Validate(); err != nil {
		return m, time.Time{}, fmt.Errorf("%s: %w", p, err)
	}
	fi, err := os.Stat(p)
	if err != nil {
		return m, time.Time{}, err
	}
	return m, fi.ModTime(), nil
}

func (m entryMeta) filesPresent(dir string) bool {
	for _, f := range []string{m.Kernel, m.Initrd, m.Disk} {
		if f == "" {
			continue
		}
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			return false
		}
	}
	return true
}

func entryDirName(d digest.Digest) string {
	return d.Algorithm().String() + "-" + d.Encoded()
}

func (s *Store) entryDir(d digest.Digest) string {
	return filepath.Join(s.root, "images", entryDirName(d))
}

// Close releases the store's lock. In-flight pulls should be cancelled first.
func (s *Store) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	s.clients.secure.CloseIdleConnections()
	s.clients.insecure.CloseIdleConnections()
	return s.lock.Close()
}

// Image is a cached image ready to serve to a VM. Paths are absolute and the
// files are read-only; use them as backing files (qcow2 overlays), never
// write to them.
type Image struct {
	Ref            string // the reference as normalized (e.g. docker.io/library/x:tag)
	Digest         string // digest the reference resolved to (index or manifest)
	ManifestDigest string // platform manifest actually used
	Format         Format
	Size           int64  // bytes on disk of the entry
	Kernel         string // path or ""
	Initrd         string // path or ""
	Disk           string // path or ""
	DiskFormat     string // "qcow2" or "raw" when Disk is set
	Cmdline        string // kernel command line from the artifact, or ""
}

func (s *Store) image(ref string, e *entry) *Image {
	dir := s.entryDir(e.meta.Digest)
	join := func(f string) string {
		if f == "" {
			return ""
		}
		return filepath.Join(dir, f)
	}
	return &Image{
		Ref: ref, Digest: e.meta.Digest.String(), ManifestDigest: e.meta.ManifestDigest.String(),
		Format: e.meta.Format, Size: e.meta.Size,
		Kernel: join(e.meta.Kernel), Initrd: join(e.meta.Initrd), Disk: join(e.meta.Disk),
		DiskFormat: e.meta.DiskFormat, Cmdline: e.meta.Cmdline,
	}
}

// touch records a use (for GC by age); persisted as meta.json's mtime.
// Caller holds s.mu.
func (s *Store) touch(e *entry) {
	now := time.Now()
	e.lastUsed = now
	_ = os.Chtimes(filepath.Join(s.entryDir(e.meta.Digest), "meta.json"), now, now)
}

// Acquire marks the image with this digest as in use (by a VM) until release
// is called; GC never removes an image in use. A provider re-acquires the
// images of its running VMs after a restart.
func (s *Store) Acquire(dgst string) (release func(), err error) {
	d, err := digest.Parse(dgst)
	if err != nil {
		return nil, fmt.Errorf("acquire image %q: %w: %v", dgst, ErrInvalidReference, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.entries[d]
	if !ok {
		return nil, fmt.Errorf("acquire image %s: %w", dgst, ErrNotFound)
	}
	e.refs++
	s.touch(e)
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			e.refs--
			s.touch(e)
		})
	}, nil
}

// CachedImage describes one cached image for node.status.images.
type CachedImage struct {
	Digest   string
	Names    []string // references that resolved to it, plus "repo@digest" forms
	Size     int64
	InUse    int
	LastUsed time.Time
}

// List returns the cached images, largest first (as the kubelet reports them).
func (s *Store) List() []CachedImage {
	s.mu.Lock()
	defer s.mu.Unlock()
	byDigest := map[digest.Digest][]string{}
	for n, d := range s.names {
		byDigest[d] = append(byDigest[d], n)
		if repo, _, ok := strings.Cut(n, "@"); ok {
			_ = repo // already a digest reference
		} else if i := strings.LastIndex(n, ":"); i > strings.LastIndex(n, "/") {
			byDigest[d] = append(byDigest[d], n[:i]+"@"+d.String())
		}
	}
	out := make([]CachedImage, 0, len(s.entries))
	for d, e := range s.entries {
		names := dedupSorted(byDigest[d])
		out = append(out, CachedImage{Digest: d.String(), Names: names, Size: e.meta.Size, InUse: e.refs, LastUsed: e.lastUsed})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Size != out[j].Size {
			return out[i].Size > out[j].Size
		}
		return out[i].Digest < out[j].Digest
	})
	return out
}

func dedupSorted(in []string) []string {
	sort.Strings(in)
	out := in[:0]
	for i, v := range in {
		if i == 0 || v != in[i-1] {
			out = append(out, v)
		}
	}
	return out
}

// GCPolicy bounds the cache. Zero fields disable that bound.
type GCPolicy struct {
	MaxBytes int64         // total size of entries to keep
	MaxAge   time.Duration // entries unused for longer are removed
}

// GCResult reports what GC did.
type GCResult struct {
	Removed    []string // digests
	FreedBytes int64
	KeptInUse  int   // entries over a bound but kept because in use
	TotalBytes int64 // size of the entries left
}

// GC removes unused entries older than MaxAge, then least recently used
// entries until the total is within MaxBytes. Entries in use (Acquire) or
// being pulled are never removed. It also drops stale partial downloads
// older than MaxAge and blobs no entry references.
func (s *Store) GC(ctx context.Context, p GCPolicy) (GCResult, error) {
	s.mu.Lock()
	now := time.Now()
	var res GCResult
	var total int64
	all := make([]*entry, 0, len(s.entries))
	for _, e := range s.entries {
		all = append(all, e)
		total += e.meta.Size
	}
	sort.Slice(all, func(i, j int) bool { return all[i].lastUsed.Before(all[j].lastUsed) })
	var victims []*entry
	for _, e := range all {
		tooOld := p.MaxAge > 0 && now.Sub(e.lastUsed) > p.MaxAge
		tooBig := p.MaxBytes > 0 && total > p.MaxBytes
		if !tooOld && !tooBig {
			continue
		}
		if e.refs > 0 {
			res.KeptInUse++
			continue
		}
		victims = append(victims, e)
		total -= e.meta.Size
	}
	// Unpublish victims first so no Pull can hand them out.
	for _, e := range victims {
		delete(s.entries, e.meta.Digest)
		for n, d := range s.names {
			if d == e.meta.Digest {
				delete(s.names, n)
			}
		}
	}
	names := s.namesSnapshot()
	s.mu.Unlock()
	if gcAfterSnapshot != nil {
		gcAfterSnapshot()
	}

	var errs []error
	if err := s.saveNames(names); err != nil {
		errs = append(errs, err)
	}
	for _, e := range victims {
		dir := s.entryDir(e.meta.Digest)
		// Rename first so a crash mid-delete leaves nothing that looks
		// valid (Open clears tmp/). The trash dir is unique: another GC may
		// still be deleting an earlier entry of the same digest.
		trash, err := os.MkdirTemp(filepath.Join(s.root, "tmp"), "gc-"+entryDirName(e.meta.Digest)+"-")
		if err != nil {
			errs = append(errs, fmt.Errorf("gc %s: %w", dir, err))
			continue
		}
		if err := os.Rename(dir, filepath.Join(trash, "entry")); err != nil {
			errs = append(errs, fmt.Errorf("gc %s: %w", dir, err))
			_ = os.Remove(trash)
			continue
		}
		if err := removeAll(trash); err != nil {
			errs = append(errs, fmt.Errorf("gc %s: %w", trash, err))
		}
		res.Removed = append(res.Removed, e.meta.Digest.String())
		res.FreedBytes += e.meta.Size
		s.log.Info("removed cached image", "digest", e.meta.Digest, "size", e.meta.Size)
	}
	res.TotalBytes = total
	if err := s.sweepContent(ctx, p.MaxAge, now); err != nil {
		errs = append(errs, err)
	}
	return res, errors.Join(errs...)
}

// gcAfterSnapshot, when set (tests only), runs in GC after it chose its
// victims and released s.mu: the window in which a pull may start.
var gcAfterSnapshot func()

// sweepContent deletes the blobs no entry lists and no pull uses, and
// (maxAge > 0) the partial downloads not updated for maxAge. The decision
// is taken under s.mu against the live state, not a snapshot: a pull is in
// s.inflight (registered under s.mu before it fetches anything) until its
// entry, which lists its manifests, is committed, and it marks its blobs
// busy while it needs them. So nothing is swept while any pull runs, and
// a pull that starts after the sweep fetches what it needs again.
func (s *Store) sweepContent(ctx context.Context, maxAge time.Duration, now time.Time) error {
	var blobs []digest.Digest
	if err := s.content.Walk(ctx, func(info content.Info) error {
		blobs = append(blobs, info.Digest)
		return nil
	}); err != nil {
		if !s.neverPulled() {
			return fmt.Errorf("gc: list blobs: %w", err)
		}
		blobs = nil // nothing was ever pulled: no blobs to sweep
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.inflight) > 0 {
		return nil // blobs and ingests of running pulls are not ours to touch
	}
	keep := map[digest.Digest]bool{}
	for _, e := range s.entries {
		for _, b := range e.meta.Blobs {
			keep[b] = true
		}
	}
	for d := range s.busyBlobs {
		keep[d] = true
	}
	var errs []error
	for _, d := range blobs {
		if keep[d] {
			continue
		}
		if err := s.content.Delete(ctx, d); err != nil && !errors.Is(err, os.ErrNotExist) && !errdefs.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("gc: delete blob %s: %w", d, err))
		}
	}
	if maxAge > 0 {
		sts, _ := s.content.ListStatuses(ctx)
		for _, st := range sts {
			if now.Sub(st.UpdatedAt) > maxAge {
				_ = s.content.Abort(ctx, st.Ref)
			}
		}
	}
	return errors.Join(errs...)
}

// neverPulled says whether the content store has no blobs dir: the
// content store makes it with the first blob a pull writes, so a node that
// never pulled has none (and its Walk fails on it).
func (s *Store) neverPulled() bool {
	_, err := os.Stat(filepath.Join(s.root, "content", "blobs"))
	return errors.Is(err, fs.ErrNotExist)
}

func (s *Store) namesSnapshot() map[string]digest.Digest {
	out := make(map[string]digest.Digest, len(s.names))
	for k, v := range s.names {
		out[k] = v
	}
	return out
}

// saveNames writes names.json atomically.
func (s *Store) saveNames(names map[string]digest.Digest) error {
	b, err := json.MarshalIndent(names, "", "  ")
	if err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(s.root, "names.json"), b)
}

func writeFileAtomic(p string, b []byte) error {
	f, err := os.CreateTemp(filepath.Dir(p), "."+filepath.Base(p)+".*")
	if err != nil {
		return fmt.Errorf("write %s: %w", p, err)
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(b); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", p, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", p, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", p, err)
	}
	if err := os.Rename(f.Name(), p); err != nil {
		return fmt.Errorf("write %s: %w", p, err)
	}
	return nil
}

// entryMode is the mode of an unpacked image's directory: like the store's
// other directories (0755) and its files (0444), readable by QEMU when it
// runs as a user of its own; whoever may search the store's parent may
// read the images (qemu-kubelet gives that to the VMs' group only).
const entryMode = 0o755

// removeAll removes a tree whose files may be read-only.
func removeAll(p string) error {
	_ = filepath.Walk(p, func(q string, fi os.FileInfo, err error) error {
		if err == nil && fi.IsDir() {
			_ = os.Chmod(q, 0o755)
		}
		return nil
	})
	return os.RemoveAll(p)
}

var auxNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9-]{0,62}$`)

// AuxDir returns the directory <entry>/aux/<name> next to the cached image
// dgst, created on demand, for data derived from the image that must live
// and die with it (the provider keeps VM memory snapshots there): GC removes
// it with the entry, and a new image digest has a new entry. It is not
// counted in the entry's size. Hold the image (Acquire) while writing to
// it, so GC cannot remove the entry underneath.
func (s *Store) AuxDir(dgst, name string) (string, error) {
	if !auxNameRE.MatchString(name) {
		return "", fmt.Errorf("image aux dir %q: want 1-63 characters of [a-z0-9-]", name)
	}
	d, err := digest.Parse(dgst)
	if err != nil {
		return "", fmt.Errorf("image aux dir: %w", err)
	}
	s.mu.Lock()
	_, ok := s.entries[d]
	s.mu.Unlock()
	if !ok {
		return "", fmt.Errorf("image aux dir: image %s is not cached", dgst)
	}
	dir := filepath.Join(s.entryDir(d), "aux", name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("image aux dir: %w", err)
	}
	return dir, nil
}
