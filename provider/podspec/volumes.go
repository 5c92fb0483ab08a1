package podspec

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
)

// Configuration reaches the guest as disks (docs/kubelet-api.md,
// "Configuration into the guest"):
//   - a secret or configMap volume becomes a small read-only FAT disk whose
//     label is the volume name (upper-cased by FAT; at most 11 characters)
//     and whose files are the keys (or the items' paths);
//   - a volume named "cloud-init" (secret or configMap with user-data,
//     meta-data, network-config, vendor-data) becomes a NoCloud seed: label
//     CIDATA; meta-data is generated (instance-id = pod UID, local-hostname
//     = pod name) when the volume has none;
//   - an emptyDir with sizeLimit becomes a blank qcow2 scratch disk of that
//     size, kept across VM restarts of the pod (an emptyDir lives as long
//     as the pod); the guest formats it;
//   - the container's env/envFrom become a read-only disk labelled ENV
//     holding "env" (KEY='value' lines, sourceable by a shell) and
//     "env.json";
//
// each disk has the volume name as its virtio serial
// (/dev/disk/by-id/virtio-<name>). A missing Secret/ConfigMap (or key) that
// is not optional is a ConfigError: the pod waits with reason
// CreateContainerConfigError, as on a kubelet.

// Names of the guest config disks.
const (
	// CloudInitVolumeName is the volume that becomes a NoCloud seed.
	CloudInitVolumeName = "cloud-init"
	// CloudInitLabel is the NoCloud seed's label.
	CloudInitLabel = "cidata"
	// EnvDiskLabel labels the environment disk; no volume may be named so.
	EnvDiskLabel = "env"
	// VolumesDirName holds the disks in the pod's state dir.
	VolumesDirName = "volumes"
	// ReasonCreateContainerConfigError is the kubelet's waiting reason for a
	// missing Secret/ConfigMap.
	ReasonCreateContainerConfigError = "CreateContainerConfigError"
	// ConfigRetryMax caps the back-off between looks for a missing
	// Secret/ConfigMap.
	ConfigRetryMax = 30 * time.Second
)

// ConfigError is a missing object or key the pod needs: the pod waits
// (CreateContainerConfigError) and the start is retried.
type ConfigError struct{ Msg string }

func (e *ConfigError) Error() string { return e.Msg }

// IsConfigError reports whether err is (or wraps) a ConfigError.
func IsConfigError(err error) bool {
	var ce *ConfigError
	return errors.As(err, &ce)
}

// ConfigSources reads the objects a pod's volumes and env refer to. A
// NotFound error from them means the object is missing.
type ConfigSources struct {
	Secret    func(ctx context.Context, namespace, name string) (*corev1.Secret, error)
	ConfigMap func(ctx context.Context, namespace, name string) (*corev1.ConfigMap, error)
}

// guestDisk is one disk to make for the guest (plain data).
type guestDisk struct {
	// Name is the volume name (disk serial, file name).
	Name string
	// Label of a config disk; empty for a scratch disk.
	Label string
	// Files of a config disk.
	Files map[string][]byte
	// ScratchBytes is the size of a scratch disk.
	ScratchBytes int64
}

var fatLabelRE = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,10})$`)

// hostOnlyVolume reports whether v is the secret volume of the pod's
// Jumpstarter exporter Secret (exporterSecret, ExporterSecretName): it
// is there so the Node authorizer lets this node read the Secret, and it
// never becomes a guest disk (the token stays on the host).
func hostOnlyVolume(v corev1.Volume, exporterSecret string) bool {
	return exporterSecret != "" && v.Secret != nil && v.Secret.SecretName == exporterSecret
}

// ValidateGuestVolumes checks what the pod asks of guest disks without
// reading anything: problems as "field: why" strings (for translation).
// exporterSecret is the pod's Jumpstarter exporter Secret ("" if none):
// a volume of it is the host's, not the guest's.
func ValidateGuestVolumes(spec *corev1.PodSpec, exporterSecret string) []string {
	var out []string
	for i, v := range spec.Volumes {
		f := fmt.Sprintf("spec.volumes[%d]", i)
		switch {
		case hostOnlyVolume(v, exporterSecret):
		case v.Secret != nil || v.ConfigMap != nil:
			if v.Name == CloudInitVolumeName {
				continue
			}
			if v.Name == EnvDiskLabel {
				out = append(out, fmt.Sprintf("%s.name: volume name %q is reserved for the environment disk", f, v.Name))
			} else if !fatLabelRE.MatchString(v.Name) {
				out = append(out, fmt.Sprintf("%s.name: volume %q becomes a disk labelled with its name: at most 11 characters", f, v.Name))
			}
		case v.EmptyDir != nil:
			if v.EmptyDir.Medium == corev1.StorageMediumMemory {
				out = append(out, fmt.Sprintf("%s.emptyDir.medium: volume %q: memory-backed emptyDir is not supported by VM pods (give the VM more memory and use a tmpfs in the guest)", f, v.Name))
			} else if v.EmptyDir.SizeLimit == nil || v.EmptyDir.SizeLimit.Value() <= 0 {
				out = append(out, fmt.Sprintf("%s.emptyDir.sizeLimit: volume %q: required: an emptyDir becomes a scratch disk of that size", f, v.Name))
			}
		}
	}
	return out
}

// ValidateGuestEnv checks the container's env for what the environment
// disk can carry: problems as "field: why" strings (for translation).
func ValidateGuestEnv(c *corev1.Container, field string) []string {
	var out []string
	for i, e := range c.Env {
		if e.ValueFrom == nil {
			continue
		}
		f := fmt.Sprintf("%s.env[%d].valueFrom", field, i)
		switch vf := e.ValueFrom; {
		case vf.SecretKeyRef != nil, vf.ConfigMapKeyRef != nil:
		case vf.FieldRef != nil:
			if _, err := podField(&corev1.Pod{}, vf.FieldRef.FieldPath); err != nil {
				out = append(out, fmt.Sprintf("%s.fieldRef: %v", f, err))
			}
		default:
			out = append(out, fmt.Sprintf("%s: env %q: only value, secretKeyRef, configMapKeyRef and fieldRef are supported for VM pods", f, e.Name))
		}
	}
	return out
}

// planGuestDisks reads what pod's volumes and env refer to and returns the
// disks to make, in volume order (env disk last). Missing objects or keys
// give a ConfigError naming them.
func planGuestDisks(ctx context.Context, pod *corev1.Pod, src ConfigSources) ([]guestDisk, error) {
	var out []guestDisk
	exporterSecret := ExporterSecretName(pod)
	for _, v := range pod.Spec.Volumes {
		switch {
		case hostOnlyVolume(v, exporterSecret):
		case v.Secret != nil || v.ConfigMap != nil:
			data, optional, err := volumeData(ctx, pod.Namespace, v, src)
			if err != nil {
				return nil, err
			}
			if data == nil && optional {
				data = map[string][]byte{}
			}
			files, err := projectItems(v, data, optional)
			if err != nil {
				return nil, err
			}
			d := guestDisk{Name: v.Name, Label: v.Name, Files: files}
			if v.Name == CloudInitVolumeName {
				d.Label = CloudInitLabel
				if _, ok := d.Files["meta-data"]; !ok {
					d.Files["meta-data"] = []byte(fmt.Sprintf("instance-id: %s\nlocal-hostname: %s\n", pod.UID, pod.Name))
				}
			}
			out = append(out, d)
		case v.EmptyDir != nil && v.EmptyDir.SizeLimit != nil:
			out = append(out, guestDisk{Name: v.Name, ScratchBytes: v.EmptyDir.SizeLimit.Value()})
		}
	}
	if len(pod.Spec.Containers) > 0 {
		env, err := resolveEnv(ctx, pod, &pod.Spec.Containers[0], src)
		if err != nil {
			return nil, err
		}
		if len(env) > 0 {
			out = append(out, guestDisk{Name: EnvDiskLabel, Label: EnvDiskLabel, Files: envFiles(env)})
		}
	}
	login, err := exporterGuestLogin(ctx, pod, src) // guestlogin.go
	if err != nil {
		return nil, err
	}
	return withGuestLogin(out, pod, login)
}

// volumeData reads a secret/configMap volume's data; nil data with
// optional true when an optional object is missing.
func volumeData(ctx context.Context, ns string, v corev1.Volume, src ConfigSources) (map[string][]byte, bool, error) {
	if v.Secret != nil {
		optional := v.Secret.Optional != nil && *v.Secret.Optional
		s, err := GetSecret(ctx, src, ns, v.Secret.SecretName)
		if err != nil || s == nil {
			if err == nil && optional {
				return nil, true, nil
			}
			return nil, optional, volumeErr(err, "secret", v.Secret.SecretName, v.Name)
		}
		return s.Data, optional, nil
	}
	optional := v.ConfigMap.Optional != nil && *v.ConfigMap.Optional
	cm, err := getConfigMap(ctx, src, ns, v.ConfigMap.Name)
	if err != nil || cm == nil {
		if err == nil && optional {
			return nil, true, nil
		}
		return nil, optional, volumeErr(err, "configmap", v.ConfigMap.Name, v.Name)
	}
	data := map[string][]byte{}
	for k, s := range cm.Data {
		data[k] = []byte(s)
	}
	for k, b := range cm.BinaryData {
		data[k] = b
	}
	return data, optional, nil
}

func volumeErr(err error, kind, name, vol string) error {
	if err == nil {
		return &ConfigError{Msg: fmt.Sprintf("%s %q not found (volume %q)", kind, name, vol)}
	}
	return err
}

// GetSecret returns nil, nil for a missing secret.
func GetSecret(ctx context.Context, src ConfigSources, ns, name string) (*corev1.Secret, error) {
	if src.Secret == nil {
		return nil, fmt.Errorf("secret %q: this node reads no secrets", name)
	}
	s, err := src.Secret(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("get secret %s/%s: %w", ns, name, err)
	}
	return s, nil
}

// getConfigMap returns nil, nil for a missing config map.
func getConfigMap(ctx context.Context, src ConfigSources, ns, name string) (*corev1.ConfigMap, error) {
	if src.ConfigMap == nil {
		return nil, fmt.Errorf("configmap %q: this node reads no config maps", name)
	}
	cm, err := src.ConfigMap(ctx, ns, name)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("get configmap %s/%s: %w", ns, name, err)
	}
	return cm, nil
}

// projectItems applies a volume's items (key -> path); without items every
// key is a file.
func projectItems(v corev1.Volume, data map[string][]byte, optional bool) (map[string][]byte, error) {
	items := []corev1.KeyToPath(nil)
	if v.Secret != nil {
		items = v.Secret.Items
	} else {
		items = v.ConfigMap.Items
	}
	out := map[string][]byte{}
	if len(items) == 0 {
		for k, b := range data {
			out[k] = b
		}
		return out, nil
	}
	for _, it := range items {
		b, ok := data[it.Key]
		if !ok {
			if optional {
				continue
			}
			return nil, &ConfigError{Msg: fmt.Sprintf("volume %q references non-existent key %q", v.Name, it.Key)}
		}
		out[it.Path] = b
	}
	return out, nil
}

// envVar is one resolved environment variable.
type envVar struct{ Name, Value string }

// resolveEnv resolves the container's envFrom then env (later wins, as on
// a kubelet). Supported valueFrom: secretKeyRef, configMapKeyRef and the
// fieldRefs metadata.name/namespace/uid, spec.nodeName,
// spec.serviceAccountName, metadata.labels['k'], metadata.annotations['k'].
func resolveEnv(ctx context.Context, pod *corev1.Pod, c *corev1.Container, src ConfigSources) ([]envVar, error) {
	vals := map[string]string{}
	var order []string
	set := func(k, v string) {
		if _, ok := vals[k]; !ok {
			order = append(order, k)
		}
		vals[k] = v
	}
	for _, ef := range c.EnvFrom {
		switch {
		case ef.SecretRef != nil:
			s, err := GetSecret(ctx, src, pod.Namespace, ef.SecretRef.Name)
			if err != nil {
				return nil, err
			}
			if s == nil {
				if ef.SecretRef.Optional != nil && *ef.SecretRef.Optional {
					continue
				}
				return nil, &ConfigError{Msg: fmt.Sprintf("secret %q not found", ef.SecretRef.Name)}
			}
			for _, k := range byteKeys(s.Data) {
				set(ef.Prefix+k, string(s.Data[k]))
			}
		case ef.ConfigMapRef != nil:
			cm, err := getConfigMap(ctx, src, pod.Namespace, ef.ConfigMapRef.Name)
			if err != nil {
				return nil, err
			}
			if cm == nil {
				if ef.ConfigMapRef.Optional != nil && *ef.ConfigMapRef.Optional {
					continue
				}
				return nil, &ConfigError{Msg: fmt.Sprintf("configmap %q not found", ef.ConfigMapRef.Name)}
			}
			keys := make([]string, 0, len(cm.Data))
			for k := range cm.Data {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				set(ef.Prefix+k, cm.Data[k])
			}
		}
	}
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			set(e.Name, e.Value)
			continue
		}
		vf := e.ValueFrom
		switch {
		case vf.SecretKeyRef != nil:
			ref := vf.SecretKeyRef
			optional := ref.Optional != nil && *ref.Optional
			s, err := GetSecret(ctx, src, pod.Namespace, ref.Name)
			if err != nil {
				return nil, err
			}
			if s == nil {
				if optional {
					continue
				}
				return nil, &ConfigError{Msg: fmt.Sprintf("secret %q not found", ref.Name)}
			}
			b, ok := s.Data[ref.Key]
			if !ok {
				if optional {
					continue
				}
				return nil, &ConfigError{Msg: fmt.Sprintf("couldn't find key %s in Secret %s/%s", ref.Key, pod.Namespace, ref.Name)}
			}
			set(e.Name, string(b))
		case vf.ConfigMapKeyRef != nil:
			ref := vf.ConfigMapKeyRef
			optional := ref.Optional != nil && *ref.Optional
			cm, err := getConfigMap(ctx, src, pod.Namespace, ref.Name)
			if err != nil {
				return nil, err
			}
			if cm == nil {
				if optional {
					continue
				}
				return nil, &ConfigError{Msg: fmt.Sprintf("configmap %q not found", ref.Name)}
			}
			v, ok := cm.Data[ref.Key]
			if !ok {
				if optional {
					continue
				}
				return nil, &ConfigError{Msg: fmt.Sprintf("couldn't find key %s in ConfigMap %s/%s", ref.Key, pod.Namespace, ref.Name)}
			}
			set(e.Name, v)
		case vf.FieldRef != nil:
			v, err := podField(pod, vf.FieldRef.FieldPath)
			if err != nil {
				return nil, fmt.Errorf("env %s: %w", e.Name, err)
			}
			set(e.Name, v)
		default:
			return nil, fmt.Errorf("env %s: only value, secretKeyRef, configMapKeyRef and fieldRef are supported for VM pods", e.Name)
		}
	}
	out := make([]envVar, 0, len(order))
	for _, k := range order {
		out = append(out, envVar{k, vals[k]})
	}
	return out, nil
}

func byteKeys(m map[string][]byte) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

var fieldKeyRE = regexp.MustCompile(`^metadata\.(labels|annotations)\['([^']+)'\]$`)

// podField is the downward API value of path for pod.
func podField(pod *corev1.Pod, path string) (string, error) {
	switch path {
	case "metadata.name":
		return pod.Name, nil
	case "metadata.namespace":
		return pod.Namespace, nil
	case "metadata.uid":
		return string(pod.UID), nil
	case "spec.nodeName":
		return pod.Spec.NodeName, nil
	case "spec.serviceAccountName":
		return pod.Spec.ServiceAccountName, nil
	}
	if m := fieldKeyRE.FindStringSubmatch(path); m != nil {
		if m[1] == "labels" {
			return pod.Labels[m[2]], nil
		}
		return pod.Annotations[m[2]], nil
	}
	return "", fmt.Errorf("fieldRef %q is not supported for VM pods", path)
}

// envFiles renders the environment disk's files.
func envFiles(env []envVar) map[string][]byte {
	var sh strings.Builder
	obj := make(map[string]string, len(env))
	for _, e := range env {
		fmt.Fprintf(&sh, "%s=%s\n", e.Name, shellQuote(e.Value))
		obj[e.Name] = e.Value
	}
	js, _ := json.MarshalIndent(obj, "", "  ")
	return map[string][]byte{"env": []byte(sh.String()), "env.json": append(js, '\n')}
}

// shellQuote single-quotes s for a POSIX shell.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// PrepareGuestDisks makes the pod's guest disks under <dir>/volumes and
// returns them for the VM spec: config disks are rebuilt for every run
// (content may have changed), scratch disks are created once and kept for
// the pod's life. Missing objects give a ConfigError.
func PrepareGuestDisks(ctx context.Context, dir string, pod *corev1.Pod, src ConfigSources) ([]qemu.Disk, error) {
	plan, err := planGuestDisks(ctx, pod, src)
	if err != nil || len(plan) == 0 {
		return nil, err
	}
	vdir := filepath.Join(dir, VolumesDirName)
	if err := os.MkdirAll(vdir, 0o700); err != nil {
		return nil, fmt.Errorf("guest disks: %w", err)
	}
	var disks []qemu.Disk
	for _, d := range plan {
		serial := d.Name
		if len(serial) > 20 {
			serial = serial[:20]
		}
		if d.Label == "" {
			path := filepath.Join(vdir, d.Name+".qcow2")
			if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
				if err := qemu.CreateScratchDisk(ctx, path, d.ScratchBytes); err != nil {
					return nil, fmt.Errorf("emptyDir %q: %w", d.Name, err)
				}
			}
			disks = append(disks, qemu.Disk{Path: path, Format: qemu.FormatQCOW2, Serial: serial})
			continue
		}
		path := filepath.Join(vdir, d.Name+".img")
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("volume %q: %w", d.Name, err)
		}
		if err := qemu.CreateConfigDisk(ctx, path, d.Label, d.Files); err != nil {
			return nil, fmt.Errorf("volume %q: %w", d.Name, err)
		}
		disks = append(disks, qemu.Disk{Path: path, Format: qemu.FormatRaw, ReadOnly: true, Serial: serial})
	}
	return disks, nil
}
