package jumpstarter_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/ulikunitz/xz"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
)

// diskTarget is a fakeTarget with partitions (jumpstarter.DiskTarget): a
// partition's bytes change only when WritePartition read its image to a
// clean end, as the VM's contract asks.
type diskTarget struct {
	*fakeTarget
	mu       sync.Mutex
	parts    map[string][]byte
	limits   map[string]int64
	writes   map[string]int // installed writes by partition
	ociParts []string       // FlashOCI calls: partition=ref
	ociDials []jumpstarter.Dialer
	ociCreds []*jumpstarter.RegistryCredentials
	onOCI    func() // called as FlashOCI starts (nil: nothing)
	// block, when set, holds the first WritePartition (after it read its
	// image) until it is closed; blocked is closed once one waits there.
	block   chan struct{}
	blocked chan struct{}
}

// waitBlocked waits until a WritePartition waits on block.
func (d *diskTarget) waitBlocked(t *testing.T) {
	t.Helper()
	select {
	case <-d.blocked:
	case <-time.After(time.Minute):
		t.Fatal("no WritePartition reached the block")
	}
}

func newDiskTarget(f *fakeTarget) *diskTarget {
	return &diskTarget{fakeTarget: f, writes: map[string]int{}, blocked: make(chan struct{}), parts: map[string][]byte{"OVMF_CODE.fd": []byte("node-default-ovmf-code")},
		limits: map[string]int64{"root": 8 << 20, "bios": 1 << 20, "OVMF_CODE.fd": 1 << 20, "OVMF_VARS.fd": 1 << 20}}
}

func (d *diskTarget) PartitionLimit(p string) (int64, error) {
	l, ok := d.limits[p]
	if !ok {
		return 0, fmt.Errorf("%w: no partition %q", jumpstarter.ErrInvalidArgument, p)
	}
	return l, nil
}

func (d *diskTarget) WritePartition(ctx context.Context, p string, img io.Reader, progress func(string)) error {
	var aside bytes.Buffer // written aside
	if _, err := io.Copy(&aside, img); err != nil {
		return err
	}
	progress(fmt.Sprintf("installing %d bytes", aside.Len()))
	d.mu.Lock()
	if b := d.block; b != nil {
		d.block = nil
		close(d.blocked)
		d.mu.Unlock()
		<-b
		d.mu.Lock()
	}
	defer d.mu.Unlock()
	d.parts[p] = aside.Bytes()
	d.writes[p]++
	return nil
}

func (d *diskTarget) ReadPartition(_ context.Context, p string) (io.ReadCloser, int64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	b, ok := d.parts[p]
	if !ok {
		return nil, 0, fmt.Errorf("%w: nothing flashed on %s", jumpstarter.ErrInvalidArgument, p)
	}
	return io.NopCloser(bytes.NewReader(b)), int64(len(b)), nil
}

func (d *diskTarget) FlashOCI(_ context.Context, f jumpstarter.OCIFlash, progress func(string)) error {
	if d.onOCI != nil {
		d.onOCI()
	}
	progress("pulling " + f.Ref)
	d.mu.Lock()
	defer d.mu.Unlock()
	d.ociParts = append(d.ociParts, f.Partition+"="+f.Ref)
	d.ociDials = append(d.ociDials, f.Dial)
	d.ociCreds = append(d.ociCreds, f.Credentials)
	return nil
}

func (d *diskTarget) part(p string) ([]byte, int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.parts[p], d.writes[p]
}

// leased starts an exporter (with mutate), leases it and dials it.
func leased(t *testing.T, mutate func(*jumpstarter.Config)) (*env, *jstest.Session, func(string) string) {
	t.Helper()
	e := startEnv(t, true, mutate)
	ctx := ctxT(t, 30*time.Second)
	_, err := e.ctrl.WaitExporter(ctx, ns, name, online)
	require.NoError(t, err)
	require.NoError(t, e.ctrl.AssignLease(ns, "lease-1", name, "alice"))
	_, err = e.ctrl.WaitExporter(ctx, ns, name, leaseReady)
	require.NoError(t, err)
	s, err := e.ctrl.NewClient(ns, "alice").Dial(ctx, "lease-1")
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	rep, err := s.GetReport(ctx)
	require.NoError(t, err)
	return e, s, func(n string) string {
		d, ok := jstest.FindDriver(rep, n)
		require.True(t, ok, n)
		return d.GetUuid()
	}
}

func withDisk(opts jumpstarter.ResourceOptions) (func(*jumpstarter.Config), func() *diskTarget) {
	var dt *diskTarget
	return func(c *jumpstarter.Config) {
			dt = newDiskTarget(c.Target.(*fakeTarget))
			c.Target = dt
			c.Resources = opts
		}, func() *diskTarget {
			return dt
		}
}

func randomImage(t testing.TB, n int) []byte {
	b := make([]byte, n)
	_, err := rand.Read(b[:n/2])
	require.NoError(t, err)
	copy(b[n/2:], bytes.Repeat([]byte("qemu-kubelet "), n/26+1)) // a compressible half
	return b
}

func compress(t testing.TB, enc string, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	switch enc {
	case "bz2", "xz": // Go has no bzip2 encoder; xz's is slow under -race
		tool := map[string]string{"bz2": "bzip2", "xz": "xz"}[enc]
		cmd := exec.Command(tool, "-c")
		cmd.Stdin = bytes.NewReader(b)
		out, err := cmd.Output()
		require.NoError(t, err, "%s (Debian's %s)", tool, tool)
		return out
	default:
		w, err := jstest.Encode(enc, &buf)
		require.NoError(t, err)
		_, err = w.Write(b)
		require.NoError(t, err)
		require.NoError(t, w.Close())
	}
	return buf.Bytes()
}

// TestFlashAndDumpResources: flash from a client file through the router
// onto every partition, raw and compressed (detected by signature), with
// and without a content encoding the exporter accepts, and dump each back
// byte for byte, as FlasherClient.flash/dump do.
func TestFlashAndDumpResources(t *testing.T) {
	mutate, target := withDisk(jumpstarter.ResourceOptions{})
	e, s, uuidOf := leased(t, mutate)
	ctx := ctxT(t, 5*time.Minute)
	fl := uuidOf("flasher")
	img := randomImage(t, 1<<20+17)

	t.Run("DumpDefaultPartition", func(t *testing.T) {
		var back bytes.Buffer
		require.NoError(t, s.Dump(ctx, fl, &back, "OVMF_CODE.fd", ""))
		assert.Equal(t, "node-default-ovmf-code", back.String())
	})

	t.Run("DumpFlashedPrefix", func(t *testing.T) {
		// flashed:P reaches the target as it is (it says what was flashed);
		// the prefix before no partition is refused.
		target().mu.Lock()
		target().parts["flashed:OVMF_CODE.fd"] = []byte("what was flashed")
		target().mu.Unlock()
		var back bytes.Buffer
		require.NoError(t, s.Dump(ctx, fl, &back, "flashed:OVMF_CODE.fd", ""))
		assert.Equal(t, "what was flashed", back.String())
		_, err := s.Call(ctx, fl, "dump", map[string]any{"kind": "presigned_request", "method": "PUT", "url": "https://storage.example/x", "headers": map[string]any{}}, "flashed:efi")
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		assert.Contains(t, status.Convert(err).Message(), `dump also takes each with the prefix "flashed:"`)
	})

	for _, c := range []struct {
		part        any
		file        string // compression of the file the client flashes
		compression string // the client's --compression
	}{
		{nil, "", ""},
		{"root", "xz", ""},
		{"root", "gzip", ""},
		{"root", "bz2", ""},
		{"root", "zstd", ""},
		{"root", "xz", "xz"},       // accepted: the exporter decodes the stream
		{"root", "zstd", "zstd"},   // accepted
		{"root", "bz2", "bz2"},     // not accepted: the client decodes
		{"bios", "gzip", ""},       // firmware partitions
		{"OVMF_CODE.fd", "", ""},   //
		{"OVMF_VARS.fd", "xz", ""}, //
	} {
		t.Run(fmt.Sprintf("%v/%s/%s", c.part, c.file, c.compression), func(t *testing.T) {
			want := img
			if c.part != nil && c.part != "root" {
				want = img[:256<<10] // firmware partitions are small
			}
			src := want
			if c.file != "" {
				src = compress(t, c.file, want)
			}
			p := "root"
			if c.part != nil {
				p = c.part.(string)
			}
			_, writes := target().part(p)
			require.NoError(t, s.Flash(ctx, fl, bytes.NewReader(src), c.part, c.compression))
			got, writes2 := target().part(p)
			assert.Equal(t, writes+1, writes2)
			require.True(t, bytes.Equal(want, got), "partition %s holds the decompressed image (%d bytes, want %d)", p, len(got), len(want))

			var back bytes.Buffer
			require.NoError(t, s.Dump(ctx, fl, &back, c.part, ""))
			require.True(t, bytes.Equal(want, back.Bytes()), "dump returns the flashed bytes (%d, want %d)", back.Len(), len(want))
		})
	}

	t.Run("DumpEncoded", func(t *testing.T) {
		for _, enc := range []string{"gzip", "xz", "zstd"} {
			var back bytes.Buffer
			require.NoError(t, s.Dump(ctx, fl, &back, "OVMF_VARS.fd", enc), enc)
			r, err := jstest.Decode(enc, &back)
			require.NoError(t, err)
			got, err := io.ReadAll(r)
			require.NoError(t, err)
			want, _ := target().part("OVMF_VARS.fd")
			require.True(t, bytes.Equal(want, got), "%s dump decodes to the partition", enc)
		}
	})

	t.Run("AcceptEncoding", func(t *testing.T) {
		for enc, accepted := range map[string]bool{"gzip": true, "xz": true, "zstd": true, "bz2": false, "": false} {
			r, err := s.OpenResource(ctx, fl, enc)
			require.NoError(t, err)
			assert.Equal(t, "client_stream", r.Handle["kind"])
			assert.Regexp(t, `^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`, r.Handle["uuid"])
			if accepted {
				assert.Equal(t, enc, r.AcceptEncoding)
				assert.Equal(t, enc, r.Handle["x_jmp_content_encoding"])
			} else {
				assert.Empty(t, r.AcceptEncoding, enc)
				assert.Nil(t, r.Handle["x_jmp_content_encoding"], enc)
			}
			r.Conn.Close()
		}
	})

	t.Run("FlashOCIOntoPartitions", func(t *testing.T) {
		err := s.StreamingCall(ctx, fl, "flash_oci", []any{"oci://registry.local/fw:1", "bios"}, func(any) error { return nil })
		require.NoError(t, err)
		_, err = s.Call(ctx, fl, "flash", "oci://registry.local/fw:2", "OVMF_VARS.fd")
		require.NoError(t, err)
		assert.Equal(t, []string{"bios=registry.local/fw:1", "OVMF_VARS.fd=registry.local/fw:2"}, target().ociParts)
		err = s.StreamingCall(ctx, fl, "flash_oci", []any{"oci://registry.local/fw:1", "efi"}, func(any) error { return nil })
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		assert.Contains(t, status.Convert(err).Message(), `invalid partition name: "efi"`)
	})
	// A stream's server side records its close on its own goroutine, after
	// the client's Close returned: wait for it.
	e.rec.waitFor(t, "every resource stream closed", 10*time.Second, func() bool {
		e.rec.mu.Lock()
		defer e.rec.mu.Unlock()
		return e.rec.opened["resource"] == e.rec.closed["resource"]
	})
	e.rec.mu.Lock()
	assert.Equal(t, e.rec.opened["resource"], e.rec.closed["resource"], "every resource stream closed")
	assert.Greater(t, e.rec.opened["resource"], 10)
	e.rec.mu.Unlock()
}

// TestFlashResourceFailures: every way a flash can fail leaves the target
// as it was (no partition written), and the call says why with the gRPC
// code upstream's drivers use.
func TestFlashResourceFailures(t *testing.T) {
	// Timeouts a healthy transfer never meets here: it may pause longer
	// than the short ones the stall cases need (under -race on a loaded
	// machine it did, failing "the client sent nothing for 500ms"); those
	// run on an exporter of their own (Stalls). WaitTimeout bounds the wait
	// for a resource of another driver (BadArguments).
	mutate, target := withDisk(jumpstarter.ResourceOptions{WaitTimeout: 2 * time.Second, StallTimeout: time.Minute})
	e, s, uuidOf := leased(t, mutate)
	ctx := ctxT(t, 5*time.Minute)
	fl := uuidOf("flasher")
	img := randomImage(t, 1<<20)
	require.NoError(t, s.Flash(ctx, fl, bytes.NewReader(img), "root", ""))
	_, writes := target().part("root")

	unchanged := func(t *testing.T) {
		t.Helper()
		got, w := target().part("root")
		assert.Equal(t, writes, w, "nothing installed")
		assert.True(t, bytes.Equal(img, got), "root still holds the last good image")
	}
	flashWith := func(t *testing.T, r *jstest.Resource, part any) error {
		_, err := s.Call(ctx, fl, "flash", r.Handle, part)
		return err
	}

	t.Run("ClientStopsMidStream", func(t *testing.T) {
		r, err := s.OpenResource(ctx, fl, "")
		require.NoError(t, err)
		errc := make(chan error, 1)
		go func() { errc <- flashWith(t, r, "root") }()
		_, err = r.Conn.Write(img[:300<<10])
		require.NoError(t, err)
		time.Sleep(100 * time.Millisecond)
		r.Abort() // the client dies: no GOAWAY
		err = <-errc
		require.Error(t, err)
		assert.Contains(t, status.Convert(err).Message(), "resource stream ended abnormally after")
		unchanged(t)
	})

	t.Run("Stalls", func(t *testing.T) {
		mutate, target := withDisk(jumpstarter.ResourceOptions{WaitTimeout: 300 * time.Millisecond, StallTimeout: 500 * time.Millisecond})
		_, s, uuidOf := leased(t, mutate)
		fl := uuidOf("flasher")
		before, writes := target().part("root")
		unchanged := func(t *testing.T) {
			t.Helper()
			got, w := target().part("root")
			assert.Equal(t, writes, w, "nothing installed")
			assert.True(t, bytes.Equal(before, got), "root unchanged")
		}
		t.Run("ClientStalls", func(t *testing.T) {
			r, err := s.OpenResource(ctx, fl, "")
			require.NoError(t, err)
			defer r.Conn.Close()
			_, err = r.Conn.Write(img[:64<<10])
			require.NoError(t, err)
			_, err = s.Call(ctx, fl, "flash", r.Handle, "root")
			assert.Equal(t, codes.DeadlineExceeded, status.Code(err), "%v", err)
			assert.Contains(t, status.Convert(err).Message(), "the client sent nothing for 500ms (after 65536 bytes)")
			unchanged(t)
		})
		t.Run("ResourceNeverComes", func(t *testing.T) {
			h := map[string]any{"kind": "client_stream", "uuid": "0b8b2c5e-7a4e-4c51-9d0e-3a1f6f1f2a00", "x_jmp_content_encoding": nil}
			t0 := time.Now()
			_, err := s.Call(ctx, fl, "flash", h, "root")
			assert.Equal(t, codes.DeadlineExceeded, status.Code(err), "%v", err)
			assert.Contains(t, status.Convert(err).Message(), "never came")
			assert.GreaterOrEqual(t, time.Since(t0), 300*time.Millisecond, "waited for it")
			unchanged(t)
		})
	})

	corrupt := func(t *testing.T, src []byte, compression, want string) {
		t.Helper()
		err := s.Flash(ctx, fl, bytes.NewReader(src), "root", compression)
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		assert.Contains(t, status.Convert(err).Message(), want)
		unchanged(t)
	}
	t.Run("CorruptXZ", func(t *testing.T) {
		c := compress(t, "xz", img)
		c[len(c)/2] ^= 0xff
		c[len(c)/2+1] ^= 0xff
		corrupt(t, c, "", "the xz stream is corrupt")
	})
	t.Run("TruncatedGzip", func(t *testing.T) {
		c := compress(t, "gzip", img)
		corrupt(t, c[:len(c)/2], "", "the gzip stream is truncated")
	})
	t.Run("TruncatedZstdEncoded", func(t *testing.T) {
		c := compress(t, "zstd", img)
		corrupt(t, c[:len(c)/2], "zstd", "zstd stream")
	})
	t.Run("CorruptBZ2", func(t *testing.T) {
		c := compress(t, "bz2", img)
		c[len(c)/2] ^= 0xff
		corrupt(t, c, "", "the bz2 stream is corrupt")
	})
	t.Run("XZDictionaryTooLarge", func(t *testing.T) {
		var buf bytes.Buffer
		w, err := xz.WriterConfig{DictCap: 128 << 20}.NewWriter(&buf)
		require.NoError(t, err)
		_, _ = w.Write(img[:1024])
		require.NoError(t, w.Close())
		corrupt(t, buf.Bytes(), "", "needs a 128 MiB dictionary")
	})
	t.Run("TooLargeForPartition", func(t *testing.T) {
		before, _ := target().part("bios")
		err := s.Flash(ctx, fl, bytes.NewReader(compress(t, "gzip", make([]byte, 1<<20+1))), "bios", "")
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		assert.Contains(t, status.Convert(err).Message(), "larger than partition bios may hold (1048576 bytes)")
		after, _ := target().part("bios")
		assert.True(t, bytes.Equal(before, after))
		require.NoError(t, s.Flash(ctx, fl, bytes.NewReader(make([]byte, 1<<20)), "bios", ""), "exactly the limit fits")
	})
	t.Run("Empty", func(t *testing.T) {
		corrupt(t, nil, "", "the image is empty")
	})
	t.Run("BadArguments", func(t *testing.T) {
		r, err := s.OpenResource(ctx, fl, "")
		require.NoError(t, err)
		defer r.Conn.Close()
		_, err = s.Call(ctx, fl, "flash", r.Handle, "boot")
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		_, err = s.Call(ctx, fl, "flash", map[string]any{"kind": "magnet"}, "root")
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		_, err = s.Call(ctx, fl, "dump", map[string]any{"kind": "presigned_request", "url": "file:///etc/shadow", "method": "PUT", "headers": map[string]any{}}, "root")
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		// A handle serves one call: the second use is refused.
		go func() { _, _ = r.Conn.Write(img[:1000]); _ = r.Conn.CloseWrite() }()
		_, err = s.Call(ctx, fl, "flash", r.Handle, "OVMF_VARS.fd")
		require.NoError(t, err)
		_, err = s.Call(ctx, fl, "flash", r.Handle, "OVMF_VARS.fd")
		require.Error(t, err)
		// A resource opened for another driver is not the flasher's.
		r2, err := s.OpenResource(ctx, uuidOf("power"), "")
		require.NoError(t, err)
		defer r2.Conn.Close()
		_, err = s.Call(ctx, fl, "flash", r2.Handle, "root")
		assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		assert.Contains(t, status.Convert(err).Message(), "another driver")
		unchanged(t)
	})

	t.Run("DumpClientStops", func(t *testing.T) {
		big := randomImage(t, 8<<20)
		require.NoError(t, s.Flash(ctx, fl, bytes.NewReader(big), "root", ""))
		r, err := s.OpenResource(ctx, fl, "")
		require.NoError(t, err)
		errc := make(chan error, 1)
		go func() {
			_, err := s.Call(ctx, fl, "dump", r.Handle, "root")
			errc <- err
		}()
		buf := make([]byte, 100<<10)
		_, err = io.ReadFull(r.Conn, buf)
		require.NoError(t, err)
		r.Abort()
		err = <-errc
		require.Error(t, err, "the dump fails when the client goes away")
		assert.Contains(t, status.Convert(err).Message(), "dump root")
	})
	assert.NotContains(t, e.logs.String(), "BEGIN", "no key material in logs")
}

// TestTargetWithoutDisk: a Target that is not a DiskTarget answers flash
// and dump of a handle Unimplemented, as upstream's drivers answer a
// NotImplementedError.
func TestTargetWithoutDisk(t *testing.T) {
	_, s, uuidOf := leased(t, nil)
	ctx := ctxT(t, 30*time.Second)
	r, err := s.OpenResource(ctx, uuidOf("flasher"), "")
	require.NoError(t, err)
	defer r.Conn.Close()
	_, err = s.Call(ctx, uuidOf("flasher"), "flash", r.Handle, nil)
	assert.Equal(t, codes.Unimplemented, status.Code(err), "%v", err)
	_, err = s.Call(ctx, uuidOf("flasher"), "dump", r.Handle, nil)
	assert.Equal(t, codes.Unimplemented, status.Code(err), "%v", err)
}

// TestPresignedRequests: presigned_request handles are fetched (GET,
// flash) and written (PUT, dump) by the exporter itself, with the handle's
// headers, through redirects that drop credentials across origins; the
// signature never reaches the logs; the node's own addresses are refused
// unless allowed.
func TestPresignedRequests(t *testing.T) {
	img := randomImage(t, 2<<20)
	xzImg := compress(t, "xz", img)
	var mu sync.Mutex
	var put []byte
	var gotAuth, otherAuth []string
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		otherAuth = append(otherAuth, r.Header.Get("Authorization")+"|"+r.Header.Get("X-Amz-Security-Token"))
		mu.Unlock()
		_, _ = w.Write(xzImg)
	}))
	defer other.Close()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		gotAuth = append(gotAuth, r.Header.Get("Authorization"))
		mu.Unlock()
		switch {
		case r.URL.Path == "/img.xz" && r.Method == http.MethodGet:
			if r.URL.Query().Get("X-Amz-Signature") != "s3cr3t" {
				http.Error(w, "bad signature", http.StatusForbidden)
				return
			}
			_, _ = w.Write(xzImg)
		case r.URL.Path == "/moved":
			// another origin (port): credentials must not follow
			http.Redirect(w, r, strings.Replace(other.URL, "127.0.0.1", "localhost", 1)+"/img.xz", http.StatusFound)
		case r.URL.Path == "/dump" && r.Method == http.MethodPut:
			b, _ := io.ReadAll(r.Body)
			mu.Lock()
			put = b
			mu.Unlock()
		case r.URL.Path == "/stall":
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write(xzImg[:1000])
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		default:
			http.NotFound(w, r)
		}
	}))
	defer srv.Close()
	// Healthy transfers get a stall bound no loaded -race run reaches; the
	// stall case runs on an exporter of its own with a short one.
	mutate, target := withDisk(jumpstarter.ResourceOptions{AllowLocalFetch: true, StallTimeout: time.Minute})
	e, s, uuidOf := leased(t, mutate)
	ctx := ctxT(t, 5*time.Minute)
	fl := uuidOf("flasher")
	presigned := func(method, path string) map[string]any {
		return map[string]any{"kind": "presigned_request", "method": method, "url": srv.URL + path,
			"headers": map[string]any{"Authorization": "Bearer hdr-token", "X-Amz-Security-Token": "amz-token"}}
	}

	_, err := s.Call(ctx, fl, "flash", presigned("GET", "/img.xz?X-Amz-Signature=s3cr3t"), "root")
	require.NoError(t, err)
	got, _ := target().part("root")
	require.True(t, bytes.Equal(img, got), "fetched, decompressed by signature")
	mu.Lock()
	assert.Equal(t, "Bearer hdr-token", gotAuth[len(gotAuth)-1], "the handle's headers are sent")
	mu.Unlock()

	_, err = s.Call(ctx, fl, "flash", presigned("GET", "/moved"), "OVMF_VARS.fd")
	require.Error(t, err, "the image is larger than the partition")
	_, err = s.Call(ctx, fl, "flash", presigned("GET", "/moved"), "root")
	require.NoError(t, err)
	mu.Lock()
	assert.Equal(t, []string{"|", "|"}, otherAuth, "credentials dropped on a cross-origin redirect")
	mu.Unlock()

	_, err = s.Call(ctx, fl, "flash", presigned("GET", "/img.xz?X-Amz-Signature=wrong"), "root")
	require.Error(t, err)
	assert.Contains(t, status.Convert(err).Message(), "403")
	assert.NotContains(t, status.Convert(err).Message(), "wrong", "the query is redacted")
	mutateStall, targetStall := withDisk(jumpstarter.ResourceOptions{AllowLocalFetch: true, StallTimeout: 500 * time.Millisecond})
	_, sStall, uuidOfStall := leased(t, mutateStall)
	_, err = sStall.Call(ctx, uuidOfStall("flasher"), "flash", presigned("GET", "/stall"), "root")
	assert.Equal(t, codes.DeadlineExceeded, status.Code(err), "%v", err)
	_, stallWrites := targetStall().part("root")
	assert.Equal(t, 0, stallWrites, "a stalled fetch installs nothing")
	_, err = s.Call(ctx, fl, "dump", presigned("GET", "/dump"), "root")
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "dump needs a PUT: %v", err)

	_, err = s.Call(ctx, fl, "dump", presigned("PUT", "/dump?X-Amz-Signature=s3cr3t"), "root")
	require.NoError(t, err)
	mu.Lock()
	assert.True(t, bytes.Equal(img, put), "the PUT body is the partition")
	mu.Unlock()
	assert.NotContains(t, e.logs.String(), "s3cr3t")
	assert.NotContains(t, e.logs.String(), "hdr-token")

	// By default the node's own addresses are refused.
	mutate2, _ := withDisk(jumpstarter.ResourceOptions{})
	_, s2, uuidOf2 := leased(t, mutate2)
	_, err = s2.Call(ctx, uuidOf2("flasher"), "flash", presigned("GET", "/img.xz?X-Amz-Signature=s3cr3t"), "root")
	require.Error(t, err)
	assert.Contains(t, status.Convert(err).Message(), "is the node itself: the node does not connect there for a lease")
}

// TestDecodersRefuseBombs: a zstd frame asking for a window beyond the
// bound is refused before it is allocated.
func TestDecodersRefuseBombs(t *testing.T) {
	var buf bytes.Buffer
	w, err := zstd.NewWriter(&buf, zstd.WithWindowSize(128<<20), zstd.WithEncoderLevel(zstd.SpeedFastest), zstd.WithSingleSegment(false))
	require.NoError(t, err)
	_, _ = w.Write(bytes.Repeat([]byte("x"), 1<<20))
	require.NoError(t, w.Close())
	mutate, target := withDisk(jumpstarter.ResourceOptions{})
	_, s, uuidOf := leased(t, mutate)
	ctx := ctxT(t, 30*time.Second)
	err = s.Flash(ctx, uuidOf("flasher"), bytes.NewReader(buf.Bytes()), "root", "")
	assert.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	assert.Contains(t, status.Convert(err).Message(), "zstd stream is corrupt: window size exceeded")
	_, writes := target().part("root")
	assert.Equal(t, 0, writes)
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write([]byte("ok"))
	_ = zw.Close()
	require.NoError(t, s.Flash(ctx, uuidOf("flasher"), &gz, "root", ""))
	got, _ := target().part("root")
	assert.Equal(t, "ok", string(got))
}
