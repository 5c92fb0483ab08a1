package oci

import (
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
)

// benchDisk writes size bytes of incompressible pseudo-random data.
func benchDisk(b *testing.B, p string, size int64) {
	f, err := os.Create(p)
	require.NoError(b, err)
	defer f.Close()
	rng := rand.NewChaCha8([32]byte{1, 2, 3})
	buf := make([]byte, 4<<20)
	for written := int64(0); written < size; written += int64(len(buf)) {
		_, _ = rng.Read(buf)
		_, err := f.Write(buf)
		require.NoError(b, err)
	}
}

// BenchmarkFirstPull1GiB pulls a 1 GiB raw disk artifact (pushed with oras)
// from a local docker-registry into an empty store, and in the same run
// pulls it with `oras pull` and `skopeo copy` (to an OCI layout), reporting
// our time as a ratio of each (goal <= 1.0).
func BenchmarkFirstPull1GiB(b *testing.B) {
	const size = 1 << 30
	ctx := context.Background()
	work, err := os.MkdirTemp("/tmp", "oci-bench-")
	require.NoError(b, err)
	b.Cleanup(func() { _ = removeAll(work) })
	reg := ocitest.StartRegistry(b, ocitest.RegistryOptions{})
	oras := ocitest.Oras(b)
	src := filepath.Join(work, "src")
	require.NoError(b, os.MkdirAll(src, 0o755))
	benchDisk(b, filepath.Join(src, "disk.raw"), size)
	ref := reg.Addr + "/bench/disk:1"
	ocitest.Run(ctx, b, src, oras, "push", "--no-tty", "--plain-http", "--artifact-type", ArtifactTypeOSImage, ref, "disk.raw")
	require.NoError(b, os.RemoveAll(src))

	timeIt := func(fn func(dir string)) time.Duration {
		dir, err := os.MkdirTemp(work, "out-")
		require.NoError(b, err)
		defer func() { _ = removeAll(dir) }()
		start := time.Now()
		fn(dir)
		return time.Since(start)
	}
	var ours, viaOras, viaSkopeo time.Duration
	b.ResetTimer()
	for b.Loop() {
		ours += timeIt(func(dir string) {
			s, err := Open(dir, Options{})
			require.NoError(b, err)
			defer s.Close()
			img, err := s.Pull(ctx, ref, PullOptions{})
			require.NoError(b, err)
			require.Equal(b, int64(size), img.Size)
		})
		b.StopTimer()
		viaOras += timeIt(func(dir string) {
			ocitest.Run(ctx, b, dir, oras, "pull", "--no-tty", "--plain-http", "-o", dir, ref)
		})
		viaSkopeo += timeIt(func(dir string) {
			ocitest.Run(ctx, b, dir, "skopeo", "copy", "--quiet", "--src-tls-verify=false", "docker://"+ref, "oci:"+filepath.Join(dir, "layout")+":1")
		})
		b.StartTimer()
	}
	n := float64(b.N)
	b.ReportMetric(ours.Seconds()/n, "s/pull")
	b.ReportMetric(float64(size)/(1<<20)/(ours.Seconds()/n), "MiB/s")
	b.ReportMetric(viaOras.Seconds()/n, "oras-s/pull")
	b.ReportMetric(viaSkopeo.Seconds()/n, "skopeo-s/pull")
	b.ReportMetric(ours.Seconds()/viaOras.Seconds(), "x-of-baseline-oras")
	b.ReportMetric(ours.Seconds()/viaSkopeo.Seconds(), "x-of-baseline-skopeo")
	b.ReportMetric(ours.Seconds()/min(viaOras, viaSkopeo).Seconds(), "x-of-baseline")
}

// BenchmarkServeCached measures Pull of an image already in the cache:
// IfNotPresent (no registry contact) and Always (one manifest HEAD), against
// a plain stat of the disk file as the floor.
func BenchmarkServeCached(b *testing.B) {
	ctx := context.Background()
	reg := ocitest.StartRegistry(b, ocitest.RegistryOptions{})
	dir := b.TempDir()
	benchDisk(b, filepath.Join(dir, "disk.raw"), 16<<20)
	ref := reg.Addr + "/bench/cached:1"
	ocitest.Run(ctx, b, dir, ocitest.Oras(b), "push", "--no-tty", "--plain-http", ref, "disk.raw")
	s, err := Open(b.TempDir(), Options{})
	require.NoError(b, err)
	b.Cleanup(func() { _ = s.Close() })
	img, err := s.Pull(ctx, ref, PullOptions{})
	require.NoError(b, err)

	for _, tc := range []struct {
		name   string
		policy PullPolicy
	}{{"IfNotPresent", PullIfNotPresent}, {"Always", PullAlways}} {
		b.Run(tc.name, func(b *testing.B) {
			var floor time.Duration
			for b.Loop() {
				got, err := s.Pull(ctx, ref, PullOptions{Policy: tc.policy})
				if err != nil || got.Disk != img.Disk {
					b.Fatalf("cached pull: %v", err)
				}
				b.StopTimer()
				t0 := time.Now()
				if _, err := os.Stat(img.Disk); err != nil {
					b.Fatal(err)
				}
				floor += time.Since(t0)
				b.StartTimer()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(floor.Nanoseconds()/int64(b.N)+1), "x-of-stat")
		})
	}
}
