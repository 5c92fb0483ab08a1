// Package controller reconciles ExporterSets: a pure planning step decides
// which pods to create and delete from the set, its pods and their lease
// state; a thin executor applies the plan through the Kubernetes API.
//
// It knows nothing about QEMU.
package controller
