package exporter

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// Hostile leases against one pod (flashdir.go, install.go, diskspace.go,
// target.go): each is refused or bounded with a clear error, and nothing
// else changes.

// tenantPod is a Pod whose worker installs flashes as package provider's
// does (Place, Record, then Commit or, when the record cannot be
// written, Unrecord and Undo), over a state dir on disk.
type tenantPod struct {
	dir string

	mu        sync.Mutex
	state     podstatus.VMState
	failWrite error // the status write fails with it
	flashes   []*Flash
	events    []string
}

func newTenantPod(t *testing.T) *tenantPod {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "disk.qcow2"), []byte("the tenant's disk"), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, qemu.UEFIVarsName), []byte("the tenant's UEFI variables"), 0o600))
	return &tenantPod{dir: dir}
}

func (p *tenantPod) Pod() *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "board-0"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "r/os:1"}}}}
}
func (p *tenantPod) Record() (podspec.Plan, podstatus.VMState) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return podspec.Plan{Image: "r/os:1"}, p.state
}
func (p *tenantPod) Dir() string     { return p.dir }
func (p *tenantPod) Overlay() string { return filepath.Join(p.dir, "disk.qcow2") }
func (p *tenantPod) VM() VM          { return nil }
func (p *tenantPod) Event(typ, reason, msg string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.events = append(p.events, typ+" "+reason+" "+msg)
}
func (p *tenantPod) Changed()                       {}
func (p *tenantPod) PowerOn(context.Context) error  { return nil }
func (p *tenantPod) PowerOff(context.Context) error { return nil }
func (p *tenantPod) SetSize(context.Context, func(*corev1.Pod, podspec.NodeCapacity, []*corev1.Pod) error, func(*podstatus.VMSize)) error {
	return nil
}

func (p *tenantPod) Flash(_ context.Context, f *Flash) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.flashes = append(p.flashes, f)
	placed, err := f.Place(p.dir, p.Overlay())
	if err != nil {
		return err
	}
	before := p.state
	f.Record(p.dir, &p.state)
	if p.failWrite != nil {
		f.Unrecord(&p.state, before)
		if err := placed.Undo(); err != nil {
			return err
		}
		return f.RecordError(p.failWrite)
	}
	placed.Commit()
	f.Release()
	return nil
}

// stateDirFiles are the state dir's files and their contents (the flash
// dir's by name only).
func stateDirFiles(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	require.NoError(t, filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		require.NoError(t, err)
		rel, _ := filepath.Rel(dir, path)
		switch {
		case d.IsDir():
		case strings.HasPrefix(rel, FlashDirName+"/"):
			out[rel] = "(flashed)"
		default:
			b, err := os.ReadFile(path)
			require.NoError(t, err)
			out[rel] = string(b)
		}
		return nil
	}))
	return out
}

func firmware(n int) []byte { return bytes.Repeat([]byte{0xea, 0x5b}, n/2) }

// TestSymlinkPlantedInVMDir: a link QEMU's user planted as the flash dir
// (to a dir of the node's, to be written as root) is refused: the flash
// fails with a clear error, nothing is written through the link, the pod
// is unchanged.
func TestSymlinkPlantedInVMDir(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img (a flash of root is inspected)")
	pod := newTenantPod(t)
	victim := t.TempDir()
	require.NoError(t, os.Symlink(victim, filepath.Join(pod.dir, FlashDirName)))
	tgt := NewTarget(&Node{}, pod)
	err := tgt.WritePartition(context.Background(), jumpstarter.PartitionBIOS, bytes.NewReader(firmware(64<<10)), nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "flash dir "+filepath.Join(pod.dir, FlashDirName)+" is not a directory (a link or file planted in the VM's dir?): refused")
	left, err := os.ReadDir(victim)
	require.NoError(t, err)
	assert.Empty(t, left, "nothing written through the link")
	assert.Empty(t, pod.flashes)
	_, _, err = tgt.ReadPartition(context.Background(), jumpstarter.PartitionBIOS)
	require.Error(t, err, "dump refuses it too")

	// A dir someone else may write is refused as well.
	pod2 := newTenantPod(t)
	require.NoError(t, os.Mkdir(filepath.Join(pod2.dir, FlashDirName), 0o777))
	require.NoError(t, os.Chmod(filepath.Join(pod2.dir, FlashDirName), 0o777))
	err = NewTarget(&Node{}, pod2).WritePartition(context.Background(), jumpstarter.PartitionBIOS, bytes.NewReader(firmware(64<<10)), nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "with mode 777, not the agent's alone: refused")

	// MakeFlashDir (the worker's, before QEMU runs) makes it, and a flash
	// then works.
	pod3 := newTenantPod(t)
	require.NoError(t, MakeFlashDir(pod3.dir))
	fi, err := os.Lstat(filepath.Join(pod3.dir, FlashDirName))
	require.NoError(t, err)
	assert.True(t, fi.IsDir())
	assert.Equal(t, os.FileMode(0o700), fi.Mode().Perm())
	require.NoError(t, NewTarget(&Node{}, pod3).WritePartition(context.Background(), jumpstarter.PartitionBIOS, bytes.NewReader(firmware(64<<10)), nil))
	rc, size, err := NewTarget(&Node{}, pod3).ReadPartition(context.Background(), jumpstarter.PartitionBIOS)
	require.NoError(t, err)
	defer rc.Close()
	assert.Equal(t, int64(64<<10), size)
}

// TestFlashInstallFailsHalfWay: a flash whose install fails after the old
// disk and UEFI variables were set aside (the rename into the flash dir
// fails), and one whose status write fails after it was placed and
// recorded, leave the pod's record and its state dir exactly as they
// were; the flashed file goes.
func TestFlashInstallFailsHalfWay(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img (a flash of root is inspected)")
	pod := newTenantPod(t)
	tgt := NewTarget(&Node{}, pod)
	ctx := context.Background()
	require.NoError(t, tgt.WritePartition(ctx, jumpstarter.PartitionOVMFCode, bytes.NewReader(firmware(32<<10)), nil))
	_, st0 := pod.Record()
	files0 := stateDirFiles(t, pod.dir)
	require.Contains(t, st0.Flashed, jumpstarter.PartitionOVMFCode)

	placeFault = func(part string) error { return fmt.Errorf("flash %s: the disk failed half way", part) }
	t.Cleanup(func() { placeFault = func(string) error { return nil } })
	err := tgt.WritePartition(ctx, jumpstarter.PartitionRoot, bytes.NewReader(make([]byte, 1<<20)), nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "the disk failed half way")
	_, st := pod.Record()
	assert.Equal(t, st0, st, "the record is as it was")
	assert.Equal(t, files0, stateDirFiles(t, pod.dir), "the disk, UEFI variables and flash dir are as they were")
	placeFault = func(string) error { return nil }

	pod.mu.Lock()
	pod.failWrite = fmt.Errorf("write status.json: no space left on device")
	pod.mu.Unlock()
	err = tgt.WritePartition(ctx, jumpstarter.PartitionRoot, bytes.NewReader(make([]byte, 1<<20)), nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "flash root: record it in the pod's state dir: write status.json: no space left on device")
	_, st = pod.Record()
	assert.Equal(t, st0, st, "the record is as it was")
	assert.Equal(t, files0, stateDirFiles(t, pod.dir), "the disk, UEFI variables and flash dir are as they were")
	assert.Contains(t, strings.Join(pod.events, "\n"), "Warning FlashFailed")
}

// TestTenConcurrentFlashes: ten flashes on one node at once share its
// disk: with room for about six images beyond the reserve, they never
// write into the reserve together; those that find no room left fail
// with the reason and leave no file; the others install.
func TestTenConcurrentFlashes(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img (each flash of root is inspected)")
	const image = 24 << 20
	var pods []*tenantPod
	for range 10 {
		pods = append(pods, newTenantPod(t))
	}
	// A disk with the reserve and 150 MiB free before the flashes: what
	// they wrote (the blocks of the files in their flash dirs) is gone
	// from it.
	fake := &spaceLedger{held: map[[2]int32]int64{}, statfs: func(path string) ([2]int32, int64, error) {
		fs, _, err := statfsFree(path)
		var used int64
		for _, p := range pods {
			ents, _ := os.ReadDir(filepath.Join(p.dir, FlashDirName))
			for _, e := range ents {
				if fi, err := e.Info(); err == nil {
					used += fi.Sys().(*syscall.Stat_t).Blocks * 512
				}
			}
		}
		return fs, flashFreeReserve + 150<<20 - used, err
	}}
	old := nodeDisk
	nodeDisk = fake
	t.Cleanup(func() { nodeDisk = old })
	type result struct {
		pod *tenantPod
		err error
	}
	results := make(chan result, 10)
	var wg sync.WaitGroup
	img := make([]byte, image)
	for i := range img {
		img[i] = byte(i % 251) // no zero page: every byte is written
	}
	for _, pod := range pods {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := NewTarget(&Node{}, pod).WritePartition(context.Background(), jumpstarter.PartitionRoot, bytes.NewReader(img), nil)
			results <- result{pod, err}
		}()
	}
	wg.Wait()
	close(results)
	ok, failed := 0, 0
	for r := range results {
		_, st := r.pod.Record()
		if r.err == nil {
			ok++
			assert.Contains(t, st.Flashed, jumpstarter.PartitionRoot)
			continue
		}
		failed++
		// Refused as it wrote, at the start when there was none left, or
		// by the partition size its start left it (the free space then).
		assert.Regexp(t, `the node's disk has no room left for the image|the node has no room for a root image|larger than the partition may hold \(\d+ bytes: .*the node's free space`, r.err.Error())
		assert.Empty(t, st.Flashed, "a refused flash installs nothing")
		ents, err := os.ReadDir(filepath.Join(r.pod.dir, FlashDirName))
		if !errors.Is(err, fs.ErrNotExist) {
			require.NoError(t, err)
		}
		assert.Empty(t, ents, "and leaves no file")
	}
	t.Logf("%d flashes installed, %d refused for room", ok, failed)
	assert.Equal(t, 10, ok+failed)
	assert.Positive(t, ok, "some flashes fit")
	assert.Positive(t, failed, "ten do not fit")
	assert.LessOrEqual(t, int64(ok*image), int64(150<<20), "together they never wrote into the reserve")
	assert.Empty(t, fake.held, "every hold ended")
}

// dockerConfig is a Docker config JSON document for one registry.
func dockerConfig(host, user, pass string) []byte {
	auth := base64.StdEncoding.EncodeToString([]byte(user + ":" + pass))
	return []byte(fmt.Sprintf(`{"auths":{%q:{"auth":%q}}}`, host, auth))
}

// TestFlashOCIPrivateImageNeedsTheCallersCredentials: the pod's pull
// secrets pulled a private image (its digest is in the node's cache); a
// lease's flash_oci of that digest without credentials is refused by the
// registry, as the cached copy is served only after the registry handed
// the manifest to the caller's credentials; with them it flashes from
// the cache (no layer downloaded again), onto root and onto a firmware
// partition. A registry that claims the cached digest without holding
// its manifest gets nothing from the cache, and the pull dials through
// the lease's fetch policy.
func TestFlashOCIPrivateImageNeedsTheCallersCredentials(t *testing.T) {
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{User: "owner", Pass: "Owner-Pa55-31"})
	proxy := ocitest.NewProxy(t, reg.Addr) // counts the registry's requests
	layout := t.TempDir()
	ocitest.WriteLayout(t, layout, "v1", ocitest.LayoutImage{
		Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"},
		Layers:   [][]byte{ocitest.Tar(ocitest.TarEntry{Name: "disk/", Type: '5'}, ocitest.TarEntry{Name: "disk/disk.raw", Body: firmware(1 << 20)})},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ref := proxy.Addr + "/private/os:1"
	ocitest.Run(ctx, t, "", "skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--dest-creds", reg.User+":"+reg.Pass, "oci:"+layout+":v1", "docker://"+ref)
	store, err := oci.Open(t.TempDir(), oci.Options{})
	require.NoError(t, err)
	cached, err := store.Pull(ctx, ref, oci.PullOptions{Auth: [][]byte{dockerConfig(proxy.Addr, reg.User, reg.Pass)}}) // the pod's start
	require.NoError(t, err)
	byDigest := proxy.Addr + "/private/os@" + cached.Digest
	blobGETs := func() int {
		n := 0
		for _, r := range proxy.Requests() {
			if r.Method == "GET" && strings.Contains(r.Path, "/blobs/") {
				n++
			}
		}
		return n
	}

	pod := newTenantPod(t)
	tgt := NewTarget(&Node{Images: store}, pod)
	owner := &jumpstarter.RegistryCredentials{Username: reg.User, Password: reg.Pass}
	for _, r := range []string{byDigest, ref} {
		err = tgt.Flash(ctx, "oci://"+r, nil)
		require.Error(t, err, r)
		assert.ErrorIs(t, err, oci.ErrUnauthorized, "%s: %v", r, err)
		err = tgt.FlashOCI(ctx, jumpstarter.OCIFlash{Ref: r, Partition: jumpstarter.PartitionBIOS}, nil)
		assert.ErrorIs(t, err, oci.ErrUnauthorized, "%s onto bios: %v", r, err)
		assert.Empty(t, pod.flashes, "%s: nothing installed", r)
	}
	err = tgt.FlashOCI(ctx, jumpstarter.OCIFlash{Ref: byDigest, Partition: jumpstarter.PartitionRoot,
		Credentials: &jumpstarter.RegistryCredentials{Username: "owner", Password: "wrong"}}, nil)
	assert.ErrorIs(t, err, oci.ErrUnauthorized, "wrong credentials: %v", err)

	proxy.Reset()
	require.NoError(t, tgt.FlashOCI(ctx, jumpstarter.OCIFlash{Ref: byDigest, Partition: jumpstarter.PartitionRoot, Credentials: owner}, nil))
	require.Len(t, pod.flashes, 1)
	assert.Equal(t, cached.Digest, pod.flashes[0].Image.Digest, "the cached image, for a caller who may pull it")
	assert.Zero(t, blobGETs(), "served from the cache: no layer downloaded again (requests: %v)", proxy.Requests())
	assert.NotEmpty(t, proxy.Requests(), "the registry was asked")

	// Credentials on a firmware partition, as upstream takes them.
	require.NoError(t, tgt.FlashOCI(ctx, jumpstarter.OCIFlash{Ref: ref, Partition: jumpstarter.PartitionBIOS, Credentials: owner}, nil))
	require.Len(t, pod.flashes, 2)
	require.NotNil(t, pod.flashes[1].Part)
	assert.Equal(t, jumpstarter.PartitionBIOS, pod.flashes[1].Part.name)

	// A registry that names the cached digest for its own tag, without
	// holding that manifest, gets nothing from the cache.
	liar := liarRegistry(t, cached.Digest)
	err = tgt.Flash(ctx, "oci://"+liar+"/evil/os:1", nil)
	require.Error(t, err)
	assert.ErrorIs(t, err, oci.ErrDigestMismatch, "%v", err)
	assert.Contains(t, err.Error(), "nothing is served from the node's cache")
	assert.Len(t, pod.flashes, 2, "nothing installed")

	// The lease's fetch policy, checked at each dial: the registry is on
	// the node's loopback, refused unless allowed.
	err = tgt.FlashOCI(ctx, jumpstarter.OCIFlash{Ref: byDigest, Partition: jumpstarter.PartitionRoot, Credentials: owner, Dial: jumpstarter.FetchPolicy{}.Dialer()}, nil)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "address 127.0.0.1 is the node itself")
	allowed := jumpstarter.FetchPolicy{AllowNets: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}}
	require.NoError(t, tgt.FlashOCI(ctx, jumpstarter.OCIFlash{Ref: byDigest, Partition: jumpstarter.PartitionRoot, Credentials: owner, Dial: allowed.Dialer()}, nil))
	assert.Len(t, pod.flashes, 3)
}

// liarRegistry is a registry that answers every manifest request for a tag
// with digest dgst (a manifest it does not have) and serves bytes that do
// not hash to it. It returns its host:port.
func liarRegistry(t *testing.T, dgst string) string {
	body := []byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","layers":[]}`)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.Contains(r.URL.Path, "/manifests/") {
			w.WriteHeader(http.StatusOK)
			return
		}
		w.Header().Set("Content-Type", ocispec.MediaTypeImageManifest)
		w.Header().Set("Docker-Content-Digest", dgst)
		w.Header().Set("Content-Length", fmt.Sprint(len(body)))
		if r.Method == http.MethodGet {
			_, _ = w.Write(body)
		}
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// TestInspectUploadUnderLimits: qemu-img runs on an upload with the
// address space and CPU limits in force (a stand-in reports its own
// limits as the image's sizes) and reads the file it was handed, a raw
// image here, as qemu-img's json says.
func TestInspectUploadUnderLimits(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img")
	f, err := os.CreateTemp(t.TempDir(), "upload-")
	require.NoError(t, err)
	defer f.Close()
	_, err = f.Write(make([]byte, 1<<20))
	require.NoError(t, err)
	info, err := inspectUpload(context.Background(), f)
	require.NoError(t, err)
	assert.Equal(t, "raw", info.Format)
	assert.Equal(t, int64(1<<20), info.VirtualSize)

	inspectCommand = []string{"/bin/sh", "-c", `printf '{"format":"raw","virtual-size":%s,"actual-size":%s}' "$(ulimit -v)" "$(ulimit -t)"`}
	t.Cleanup(func() { inspectCommand = []string{qemu.QEMUImgBinary, "info", "--output=json", "-U", "/dev/fd/3"} })
	info, err = inspectUpload(context.Background(), f)
	require.NoError(t, err)
	assert.Equal(t, int64(inspectMaxAddressSpace>>10), info.VirtualSize, "ulimit -v (KiB)")
	assert.Equal(t, int64(inspectMaxCPUSeconds), info.ActualSize, "ulimit -t (s)")

	inspectCommand = []string{"/bin/sh", "-c", `kill -XCPU $$`}
	_, err = inspectUpload(context.Background(), f)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "killed: qemu-img runs on uploads with at most 1024 MiB of address space and 30 s of CPU")
}
