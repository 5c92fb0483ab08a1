package qemu

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

// QEMUImgBinary is the qemu-img looked up in $PATH.
const QEMUImgBinary = "qemu-img"

func runTool(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}

// ImageInfo is the part of `qemu-img info` we use.
type ImageInfo struct {
	Format      string `json:"format"`
	VirtualSize int64  `json:"virtual-size"`
	ActualSize  int64  `json:"actual-size"`
	BackingFile string `json:"backing-filename"`
	// FormatSpecific.Data.DataFile is a qcow2 image's external data file.
	FormatSpecific struct {
		Data struct {
			DataFile string `json:"data-file"`
		} `json:"data"`
	} `json:"format-specific"`
}

// InspectImage runs qemu-img info (without following the backing chain).
func InspectImage(ctx context.Context, path string) (ImageInfo, error) {
	var info ImageInfo
	out, err := runTool(ctx, QEMUImgBinary, "info", "--output=json", "-U", path)
	if err != nil {
		return info, fmt.Errorf("inspect image %s: %w", path, err)
	}
	if err := json.Unmarshal(out, &info); err != nil {
		return info, fmt.Errorf("inspect image %s: decode: %w", path, err)
	}
	return info, nil
}

// CreateOverlay creates a qcow2 overlay at path backed by base (format
// baseFormat, "" to detect with qemu-img info). O(1): nothing of the base is
// copied, the base is never written. sizeBytes > 0 grows the virtual size
// beyond the base's.
func CreateOverlay(ctx context.Context, base string, baseFormat DiskFormat, path string, sizeBytes int64) error {
	absBase, err := filepath.Abs(base)
	if err != nil {
		return fmt.Errorf("create overlay %s: base %s: %w", path, base, err)
	}
	if _, err := os.Stat(absBase); err != nil {
		return fmt.Errorf("create overlay %s: base: %w", path, err)
	}
	if baseFormat == "" {
		info, err := InspectImage(ctx, absBase)
		if err != nil {
			return fmt.Errorf("create overlay %s: %w", path, err)
		}
		baseFormat = DiskFormat(info.Format)
	}
	if baseFormat != FormatQCOW2 && baseFormat != FormatRaw {
		return fmt.Errorf("create overlay %s: base format %q not supported (qcow2 or raw)", path, baseFormat)
	}
	if _, err := os.Stat(path); err == nil {
		return fmt.Errorf("create overlay %s: already exists", path)
	}
	args := []string{"create", "-q", "-f", "qcow2", "-b", absBase, "-F", string(baseFormat), path}
	if sizeBytes > 0 {
		args = append(args, fmt.Sprint(sizeBytes))
	}
	if _, err := runTool(ctx, QEMUImgBinary, args...); err != nil {
		os.Remove(path)
		return fmt.Errorf("create overlay %s: %w", path, err)
	}
	return nil
}

// GrowImage grows the virtual size of the disk image at path to sizeBytes
// (qemu-img resize); an image already that large or larger is left as it
// is (shrinking would cut the guest's data). It returns whether it grew.
// The image must not be in use.
func GrowImage(ctx context.Context, path string, sizeBytes int64) (bool, error) {
	info, err := InspectImage(ctx, path)
	if err != nil {
		return false, fmt.Errorf("grow image: %w", err)
	}
	if sizeBytes <= info.VirtualSize {
		return false, nil
	}
	if _, err := runTool(ctx, QEMUImgBinary, "resize", "-q", "-f", info.Format, path, fmt.Sprint(sizeBytes)); err != nil {
		return false, fmt.Errorf("grow image %s to %d bytes: %w", path, sizeBytes, err)
	}
	return true, nil
}

// CreateScratchDisk creates an empty sparse qcow2 disk of sizeBytes.
func CreateScratchDisk(ctx context.Context, path string, sizeBytes int64) error {
	if sizeBytes <= 0 {
		return fmt.Errorf("create scratch disk %s: size %d must be positive", path, sizeBytes)
	}
	if _, err := os.Stat(path); err == nil {
		return fmt.Errorf("create scratch disk %s: already exists", path)
	}
	if _, err := runTool(ctx, QEMUImgBinary, "create", "-q", "-f", "qcow2", path, fmt.Sprint(sizeBytes)); err != nil {
		os.Remove(path)
		return fmt.Errorf("create scratch disk %s: %w", path, err)
	}
	return nil
}

// ConfigDiskMaxBytes bounds the content of a config disk.
const ConfigDiskMaxBytes = 64 << 20

var (
	labelRE   = regexp.MustCompile(`^[A-Za-z0-9_-]{1,11}$`)
	cfgNameRE = regexp.MustCompile(`^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$`)
)

// CreateConfigDisk creates a small raw FAT (vfat) disk image at path holding
// files (relative path -> content), with the volume label (e.g. "cidata"
// for a cloud-init NoCloud seed, which accepts vfat). Attach it ReadOnly.
// Built without mounting, with mkfs.vfat and mcopy (dosfstools, mtools).
func CreateConfigDisk(ctx context.Context, path, label string, files map[string][]byte) error {
	if !labelRE.MatchString(label) {
		return fmt.Errorf("create config disk %s: label %q must be 1-11 characters of [A-Za-z0-9_-]", path, label)
	}
	var total int64
	names := make([]string, 0, len(files))
	for n, c := range files {
		if !cfgNameRE.MatchString(n) || strings.Contains("/"+n+"/", "/../") || strings.Contains("/"+n+"/", "/./") {
			return fmt.Errorf("create config disk %s: file name %q not allowed", path, n)
		}
		total += int64(len(c))
		names = append(names, n)
	}
	if total > ConfigDiskMaxBytes {
		return fmt.Errorf("create config disk %s: %d bytes of files exceed the %d byte limit", path, total, ConfigDiskMaxBytes)
	}
	sort.Strings(names)
	if _, err := os.Stat(path); err == nil {
		return fmt.Errorf("create config disk %s: already exists", path)
	}
	// FAT overhead: room for clusters and directories.
	size := (total*2 + int64(len(names))*8192 + 4<<20 + 1<<20 - 1) &^ (1<<20 - 1)
	tmp := path + ".tmp"
	fail := func(err error) error {
		os.Remove(tmp)
		return fmt.Errorf("create config disk %s: %w", path, err)
	}
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600) // it may hold a Secret
	if err != nil {
		return fail(err)
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return fail(err)
	}
	f.Close()
	if _, err := runTool(ctx, "mkfs.vfat", "-n", strings.ToUpper(label), tmp); err != nil {
		return fail(err)
	}
	// FAT labels are upper case; cloud-init NoCloud accepts "CIDATA".
	env := append(os.Environ(), "MTOOLS_SKIP_CHECK=1", "MTOOLS_NO_VFAT=0")
	mt := func(stdin []byte, args ...string) error {
		cmd := exec.CommandContext(ctx, args[0], args[1:]...)
		cmd.Env = env
		if stdin != nil {
			cmd.Stdin = bytes.NewReader(stdin)
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
		}
		return nil
	}
	dirs := map[string]bool{}
	for _, n := range names {
		for d := filepath.Dir(n); d != "."; d = filepath.Dir(d) {
			dirs[d] = true
		}
	}
	dl := make([]string, 0, len(dirs))
	for d := range dirs {
		dl = append(dl, d)
	}
	sort.Strings(dl) // parents before children
	for _, d := range dl {
		if err := mt(nil, "mmd", "-i", tmp, "::"+d); err != nil {
			return fail(err)
		}
	}
	// Each file's content goes to mcopy on its stdin: secrets (a Secret
	// volume, a seed's password) are written to no file but the disk.
	for _, n := range names {
		if err := mt(append([]byte{}, files[n]...), "mcopy", "-i", tmp, "-", "::"+n); err != nil {
			return fail(err)
		}
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(err)
	}
	return nil
}
