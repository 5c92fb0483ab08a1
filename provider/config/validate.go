package config

import (
	"fmt"
	"maps"
	"math"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

func validate(c *NodeConfiguration, env Environment) (*Node, field.ErrorList) {
	var errs field.ErrorList
	n := &Node{
		NodeName:          c.NodeName,
		NodeIP:            c.NodeIP,
		StateDir:          c.StateDir,
		QEMUBinary:        c.QEMUBinary,
		UEFICode:          c.Firmware.UEFICode,
		UEFIVars:          c.Firmware.UEFIVars,
		Reserved:          corev1.ResourceList{},
		CPUOvercommit:     *c.Overcommit.CPU,
		MemoryOvercommit:  *c.Overcommit.Memory,
		AcceleratorPolicy: c.Accelerator.Policy,
		Taints:            c.Taints,
		Labels:            c.Labels,
		ListenAddress:     c.Server.Address,
		Port:              *c.Server.Port,
		TLSCertFile:       c.Server.TLSCertFile,
		TLSKeyFile:        c.Server.TLSPrivateKeyFile,
		ClientCAFile:      c.Server.ClientCAFile,
	}

	if c.NodeName == "" {
		errs = append(errs, field.Required(field.NewPath("nodeName"), "no host name to default it from"))
	} else {
		for _, m := range validation.IsDNS1123Subdomain(c.NodeName) {
			errs = append(errs, field.Invalid(field.NewPath("nodeName"), c.NodeName, m))
		}
	}
	errs = validateFirmware(field.NewPath("firmware"), c.Firmware, errs)
	if net.ParseIP(c.NodeIP) == nil {
		errs = append(errs, field.Invalid(field.NewPath("nodeIP"), c.NodeIP, "must be an IP address"))
	}
	if !filepath.IsAbs(c.StateDir) {
		errs = append(errs, field.Invalid(field.NewPath("stateDir"), c.StateDir, "must be an absolute path"))
	}
	if c.MaxVMs != nil {
		n.MaxVMs, n.MaxVMsReason = *c.MaxVMs, fmt.Sprintf("maxVMs %d set in the configuration file", *c.MaxVMs)
		if n.MaxVMs < 1 || n.MaxVMs > MaxMaxVMs {
			errs = append(errs, field.Invalid(field.NewPath("maxVMs"), n.MaxVMs, fmt.Sprintf("must be between 1 and %d", MaxMaxVMs)))
		}
	}

	errs = validateReserved(c.Reserved, n.Reserved, errs)

	ocPath := field.NewPath("overcommit")
	for _, oc := range []struct {
		name string
		v    float64
	}{{"cpu", n.CPUOvercommit}, {"memory", n.MemoryOvercommit}} {
		name, v := oc.name, oc.v
		if !(v > 0 && v <= 100) || math.IsNaN(v) {
			errs = append(errs, field.Invalid(ocPath.Child(name), v, "must be a ratio greater than 0 and at most 100"))
		}
	}

	accPath := field.NewPath("accelerator")
	switch c.Accelerator.Policy {
	case PolicyRequireKVM, PolicyPreferKVM, PolicyTCG:
	default:
		errs = append(errs, field.NotSupported(accPath.Child("policy"), c.Accelerator.Policy, []string{PolicyRequireKVM, PolicyPreferKVM, PolicyTCG}))
	}
	n.ProbeTimeout, errs = parseDuration(accPath.Child("probeTimeout"), c.Accelerator.ProbeTimeout, time.Second, errs)

	errs = validateTaints(c.Taints, errs)
	errs = validateLabels(c.Labels, errs)

	errs = validateServer(c.Server.Address, n.Port, n.TLSCertFile, n.TLSKeyFile, errs)

	n.StatusUpdateFrequency, errs = parseDuration(field.NewPath("nodeStatusUpdateFrequency"), c.NodeStatusUpdateFrequency, time.Second, errs)

	if l := *c.NodeLeaseDurationSeconds; l < 4 || l > 3600 {
		errs = append(errs, field.Invalid(field.NewPath("nodeLeaseDurationSeconds"), l, "must be between 4 and 3600"))
	} else {
		n.LeaseDuration = time.Duration(l) * time.Second
	}

	n.KubeAPIQPS, n.KubeAPIBurst, errs = validateBudget("kubeAPIQPS", "kubeAPIBurst", *c.KubeAPIQPS, *c.KubeAPIBurst, errs)
	n.EventRecordQPS, n.EventBurst, errs = validateBudget("eventRecordQPS", "eventBurst", *c.EventRecordQPS, *c.EventBurst, errs)
	if w := *c.PodSyncWorkers; w < 1 || w > 1000 {
		errs = append(errs, field.Invalid(field.NewPath("podSyncWorkers"), w, "must be between 1 and 1000"))
	} else {
		n.PodSyncWorkers = int(w)
	}
	if v := *c.VMNice; v < 0 || v > maxNice {
		errs = append(errs, field.Invalid(field.NewPath("vmNice"), v, fmt.Sprintf("must be between 0 and %d (QEMU never runs above the agent's priority)", maxNice)))
	} else {
		n.VMNice = int(v)
	}
	for i, a := range *c.EmulatedKernelArgs {
		if msg := badKernelArg(a); msg != "" {
			errs = append(errs, field.Invalid(field.NewPath("emulatedKernelArgs").Index(i), a, msg))
		} else {
			n.EmulatedKernelArgs = append(n.EmulatedKernelArgs, a)
		}
	}

	n.CPUModels, errs = validateCPUModel(c.CPUModel, errs)

	prPath := field.NewPath("pressure")
	n.MemoryAvailable, errs = parseThreshold(prPath.Child("memoryAvailable"), c.Pressure.MemoryAvailable, errs)
	n.DiskAvailable, errs = parseThreshold(prPath.Child("diskAvailable"), c.Pressure.DiskAvailable, errs)
	n.PIDAvailable, errs = parseThreshold(prPath.Child("pidAvailable"), c.Pressure.PIDAvailable, errs)
	n.Images, errs = validateImages(c.Images, errs)
	n.VMMemory, errs = validateVMMemory(c.VMMemory, errs)
	n.VMCgroup, errs = validateVMCgroup(c.VMCgroup, errs)
	n.VMUser, errs = validateVMUser(c.VMUser, env, errs)
	n.Features, errs = validateFeatures(c.Features, errs)
	if c.MaxVMs == nil && len(errs) == 0 {
		n.MaxVMs, n.MaxVMsReason = DeriveMaxVMs(MaxVMsInput{
			MemoryTotal:      env.MemoryTotal,
			ReservedMemory:   n.Reserved.Memory().Value(),
			MemoryOvercommit: n.MemoryOvercommit,
			IdleCost:         n.VMMemory.IdleCost,
		})
	}
	return n, errs
}

// validateReserved checks reserved (cpu, memory, ephemeral-storage
// quantities, none negative) and fills out with the parsed ones.
func validateReserved(reserved map[string]QuantityString, out corev1.ResourceList, errs field.ErrorList) field.ErrorList {
	resPath := field.NewPath("reserved")
	for _, k := range slices.Sorted(maps.Keys(reserved)) {
		v := reserved[k]
		p := resPath.Key(k)
		switch corev1.ResourceName(k) {
		case corev1.ResourceCPU, corev1.ResourceMemory, corev1.ResourceEphemeralStorage:
		default:
			errs = append(errs, field.NotSupported(p, k, []string{"cpu", "memory", "ephemeral-storage"}))
			continue
		}
		q, err := resource.ParseQuantity(string(v))
		if err != nil {
			errs = append(errs, field.Invalid(p, v, "must be a resource quantity such as 500m, 2 or 1Gi"))
			continue
		}
		if q.Sign() < 0 {
			errs = append(errs, field.Invalid(p, v, "must not be negative"))
			continue
		}
		out[corev1.ResourceName(k)] = q
	}
	return errs
}

// validateTaints checks the node's taints as the API server would, and
// that no key and effect repeats.
func validateTaints(taints []corev1.Taint, errs field.ErrorList) field.ErrorList {
	taintsPath := field.NewPath("taints")
	seen := map[string]bool{}
	for i, t := range taints {
		p := taintsPath.Index(i)
		for _, m := range validation.IsQualifiedName(t.Key) {
			errs = append(errs, field.Invalid(p.Child("key"), t.Key, m))
		}
		if t.Value != "" {
			for _, m := range validation.IsValidLabelValue(t.Value) {
				errs = append(errs, field.Invalid(p.Child("value"), t.Value, m))
			}
		}
		switch t.Effect {
		case corev1.TaintEffectNoSchedule, corev1.TaintEffectPreferNoSchedule, corev1.TaintEffectNoExecute:
		default:
			errs = append(errs, field.NotSupported(p.Child("effect"), t.Effect, []string{"NoSchedule", "PreferNoSchedule", "NoExecute"}))
		}
		if t.TimeAdded != nil {
			errs = append(errs, field.Forbidden(p.Child("timeAdded"), "is set by the API server"))
		}
		id := t.Key + ":" + string(t.Effect)
		if seen[id] {
			errs = append(errs, field.Duplicate(p, id))
		}
		seen[id] = true
	}
	return errs
}

// validateLabels checks the node's labels' keys and values.
func validateLabels(labels map[string]string, errs field.ErrorList) field.ErrorList {
	labelsPath := field.NewPath("labels")
	for _, k := range slices.Sorted(maps.Keys(labels)) {
		v := labels[k]
		for _, m := range validation.IsQualifiedName(k) {
			errs = append(errs, field.Invalid(labelsPath.Key(k), k, m))
		}
		for _, m := range validation.IsValidLabelValue(v) {
			errs = append(errs, field.Invalid(labelsPath.Key(k), v, m))
		}
	}
	return errs
}

// validateServer checks the kubelet API server's address, port and TLS
// pair.
func validateServer(address string, port int32, certFile, keyFile string, errs field.ErrorList) field.ErrorList {
	srvPath := field.NewPath("server")
	if net.ParseIP(address) == nil {
		errs = append(errs, field.Invalid(srvPath.Child("address"), address, "must be an IP address"))
	}
	if port < 1 || port > 65535 {
		errs = append(errs, field.Invalid(srvPath.Child("port"), port, "must be between 1 and 65535"))
	}
	if (certFile == "") != (keyFile == "") {
		errs = append(errs, field.Invalid(srvPath.Child("tlsCertFile"), certFile, "tlsCertFile and tlsPrivateKeyFile must be set together (or both left empty for a generated self-signed pair)"))
	}
	return errs
}

// MaxKSMPagesToScan bounds vmMemory.ksmPagesToScan (the kernel takes any
// 32-bit value; beyond this ksmd would take a whole CPU on any host).
const MaxKSMPagesToScan = 100000

// MaxMaxVMs bounds maxVMs.
const MaxMaxVMs = 10000

func validateVMMemory(v VMMemory, errs field.ErrorList) (VMMemoryConfig, field.ErrorList) {
	p := field.NewPath("vmMemory")
	out := VMMemoryConfig{FreePageReporting: *v.FreePageReporting, PageMerging: *v.PageMerging, EnableKSM: *v.EnableKSM}
	quantity := func(name string, s QuantityString, min int64) int64 {
		q, err := resource.ParseQuantity(string(s))
		if err != nil {
			errs = append(errs, field.Invalid(p.Child(name), string(s), "must be a quantity such as 128Mi"))
			return 0
		}
		if q.Value() < min {
			errs = append(errs, field.Invalid(p.Child(name), string(s), fmt.Sprintf("must be at least %s", resource.NewQuantity(min, resource.BinarySI))))
			return 0
		}
		return q.Value()
	}
	out.Overhead = quantity("overhead", v.Overhead, 0)
	out.IdleCost = quantity("idleCost", v.IdleCost, 1<<20)
	if tb := quantity("tcgTranslationBuffer", v.TCGTranslationBuffer, 0); tb%(1<<20) != 0 || tb > int64(maxTBSizeMiB)<<20 {
		errs = append(errs, field.Invalid(p.Child("tcgTranslationBuffer"), string(v.TCGTranslationBuffer),
			fmt.Sprintf("must be whole MiB between 0 (QEMU's default) and %dMi", maxTBSizeMiB)))
	} else {
		out.TCGTranslationBufferMiB = int(tb >> 20)
	}
	if v.KSMPagesToScan != nil {
		switch n := *v.KSMPagesToScan; {
		case n < 0 || n > MaxKSMPagesToScan:
			errs = append(errs, field.Invalid(p.Child("ksmPagesToScan"), n, fmt.Sprintf("must be between 0 and %d", MaxKSMPagesToScan)))
		case n > 0 && !out.EnableKSM:
			errs = append(errs, field.Invalid(p.Child("ksmPagesToScan"), n, "applies only with vmMemory.enableKSM: true (the node sets it when it starts KSM)"))
		default:
			out.KSMPagesToScan = int(n)
		}
	}
	switch v.TransparentHugePages {
	case THPAuto, THPEnabled, THPDisabled:
		out.TransparentHugePages = v.TransparentHugePages
	default:
		errs = append(errs, field.NotSupported(p.Child("transparentHugePages"), v.TransparentHugePages, []string{THPAuto, THPEnabled, THPDisabled}))
	}
	if out.EnableKSM && !out.PageMerging {
		errs = append(errs, field.Invalid(p.Child("enableKSM"), true, "needs vmMemory.pageMerging: true (guest RAM is not mergeable otherwise, KSM would only cost CPU)"))
	}
	return out, errs
}

// maxNice is qemu.MaxNice (config does not import qemu).
const maxNice = 19

// maxTBSizeMiB is qemu.MaxTCGTranslationBufferMiB (config does not import qemu).
const maxTBSizeMiB = 4096

func validateFirmware(fw *field.Path, f Firmware, errs field.ErrorList) field.ErrorList {
	switch {
	case (f.UEFICode == "") != (f.UEFIVars == ""):
		errs = append(errs, field.Invalid(fw, f, "uefiCode and uefiVars: set both or neither"))
	case f.UEFICode != "":
		for _, x := range []struct{ name, v string }{{"uefiCode", f.UEFICode}, {"uefiVars", f.UEFIVars}} {
			if !filepath.IsAbs(x.v) || strings.ContainsAny(x.v, ",\n") {
				errs = append(errs, field.Invalid(fw.Child(x.name), x.v, "must be an absolute path without commas"))
			}
		}
	}
	return errs
}

// validateBudget checks a client-side rate limit: qps > 0 and burst >= qps.
func validateBudget(qpsField, burstField string, qps, burst int32, errs field.ErrorList) (float32, int, field.ErrorList) {
	if qps < 1 {
		errs = append(errs, field.Invalid(field.NewPath(qpsField), qps, "must be at least 1"))
	}
	if burst < qps {
		errs = append(errs, field.Invalid(field.NewPath(burstField), burst, "must be at least "+qpsField+" ("+strconv.Itoa(int(qps))+")"))
	}
	return float32(qps), int(burst), errs
}
func parseDuration(p *field.Path, s string, min time.Duration, errs field.ErrorList) (time.Duration, field.ErrorList) {
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, append(errs, field.Invalid(p, s, "must be a duration such as 10s or 1m"))
	}
	if d < min {
		return 0, append(errs, field.Invalid(p, s, fmt.Sprintf("must be at least %s", min)))
	}
	return d, errs
}
func parseThreshold(p *field.Path, qs QuantityString, errs field.ErrorList) (Threshold, field.ErrorList) {
	s := string(qs)
	t, err := ParseThreshold(s)
	if err != nil {
		return t, append(errs, field.Invalid(p, s, err.Error()))
	}
	return t, errs
}
